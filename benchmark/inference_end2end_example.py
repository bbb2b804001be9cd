"""The project's end-to-end replay under its published name (the README, `make demo`); the code is
benchmark/serving/end2end.py, which `python -m benchmark.serving.end2end` runs the same way.

    python benchmark/inference_end2end_example.py --data_dir artifacts/processed \\
        --checkpoint artifacts/checkpoint --output artifacts/end2end.json
"""
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a file, Python puts benchmark/ first on the path, where its groups (model/, kvcache/, data/)
    # would stand in for the library's packages: import from the repository instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmark.serving.end2end import main

if __name__ == "__main__":
    sys.exit(main())
