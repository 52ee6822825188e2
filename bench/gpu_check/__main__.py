import sys

from bench.gpu_check import main

sys.exit(main())
