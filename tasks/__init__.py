"""Lifecycle tasks (one module per task family), the sweeps and the producer API.

lease.acquire → acquire.py, lease.resume_check → resume.py, lease.destroy → destroy.py,
sandbox.reclaim → reclaim.py, run.* and lease.touch → runs.py, sweep.* → sweeps.py (and
stuck.py, orphans.py, finish_exited.py); warm pools: sweep.fill_pools and pool.provision →
pool_fill.py, the claim inside lease.acquire → pool_claim.py.
"""
