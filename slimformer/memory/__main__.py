"""``python -m slimformer.memory``: the memory report of a BERT, eager vs slimformer."""

from slimformer.memory.report import main

raise SystemExit(main())
