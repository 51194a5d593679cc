"""Course chassis shared by every lesson: the HF oracle, the smoke-script skeleton, grading."""
