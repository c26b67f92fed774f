"""Provider adapters: the contract (base.py), the registry, and each adapter."""
