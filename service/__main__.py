"""`python -m service --model-repository DIR --port 50051 --metrics-port 9464`."""

import sys

from service.server import main

if __name__ == "__main__":
    sys.exit(main())
