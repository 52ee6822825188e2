"""Drop-in torch modules over the kernels, each a subclass of the module it replaces (docs/architecture.md)."""
