#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image; the bundle is unpacked
# in /autograder/source. It makes a virtual environment with torch (CPU build) and this project's
# dependencies; run_autograder grades with that environment's python.
set -euxo pipefail
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip
python3 -m venv /autograder/venv
/autograder/venv/bin/python -m pip install --upgrade pip
/autograder/venv/bin/python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/python -m pip install -e "/autograder/source[dev]"
