"""``python -m slimformer.memory``: the memory report of a BERT, eager vs slimformer."""

from slimformer.memory.cli import main

raise SystemExit(main())
