#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image; the bundle is unpacked
# in /autograder/source. It makes a virtual environment (no system packages) with torch's CPU
# build and this project's pinned dependencies; run_autograder grades with that environment.
#
# transformers 5.22-5.23 need Python 3.11 or newer. On Gradescope's Ubuntu 24.04 base image
# (recommended) python3 is 3.12; on Ubuntu 22.04, python3 is 3.10, so python3.11 is installed
# from Ubuntu's own packages. Downloads: about 0.2 GB (torch CPU) + 0.1 GB (the rest).
#
# AUTOGRADER_ROOT (default /autograder) moves everything, to try this script elsewhere.
set -euxo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"

python_311_or_newer() {
    for candidate in python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null &&
            "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if ! PYTHON="$(python_311_or_newer)"; then
    apt-get update
    apt-get install -y --no-install-recommends python3.11 python3.11-venv
    PYTHON="$(python_311_or_newer)" || {
        echo "setup.sh: no Python 3.11+ could be installed; choose the Ubuntu 24.04 base image" >&2
        exit 2
    }
fi
"$PYTHON" -m venv --clear "$ROOT/venv" || {  # Ubuntu's python3 lacks venv until python3-venv is in
    apt-get update
    apt-get install -y --no-install-recommends "$(basename "$PYTHON")-venv"
    "$PYTHON" -m venv --clear "$ROOT/venv"
}
"$ROOT/venv/bin/python" -m pip install --upgrade pip
# torch's CPU build; where PyTorch's CPU index cannot be reached, one line says so and torch comes
# from the default index (PyPI) instead: set-up does not fail for that reason.
"$ROOT/venv/bin/python" "$ROOT/source/scripts/install_torch.py" --python "$ROOT/venv/bin/python" --build cpu
"$ROOT/venv/bin/python" -m pip install -e "$ROOT/source[dev]"
# The grader's environment holds transformers, HF's Qwen3: the oracle. Only the judge's user may
# read it (grade.py runs the judged tests as that user); the student's code gets an environment of
# its own when it is graded (grade.py's worker_environment), so no path leads it here.
JUDGE_USER="${AUTOGRADER_JUDGE_USER:-autograder-judge}"
id -u "$JUDGE_USER" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$JUDGE_USER"
chgrp -R "$(id -gn "$JUDGE_USER")" "$ROOT/venv"
chmod -R o-rwx "$ROOT/venv"
