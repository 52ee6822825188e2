"""``python -m slimformer.plan``: will a HF BERT's training step fit a memory budget?"""

from slimformer.plan.cli import main

raise SystemExit(main())
