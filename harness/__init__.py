"""Course chassis shared by every lesson: the HF oracle, the smoke-script skeleton, grading."""

import os as _os

if _os.environ.get("KVCOURSE_JUDGE"):
    # The judge (harness/judge.py): from here on, this process imports the lesson packages (and
    # tests/probes*.py) from a worker process and never runs the student's code. Every process
    # that imports the harness does so, the smoke scripts the tests start included.
    from harness import judge as _judge

    _judge.install_from_environment()
