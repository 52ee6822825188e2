"""Developer tools that work on the repository, beside it and not shipped with slimformer."""
