"""The model's quantised building blocks: the reference maths of the FP8 / FP4 formats
(``quant.py``) and the modules that hold the stored bytes and call the kernels (``linear.py``)."""
