"""The Buffer's ``dtype`` argument: names, NumPy dtypes and scalar types resolve; others are refused."""
import ml_dtypes
import numpy as np
import pytest

from ep_comm.contract.choices import payload_dtype


@pytest.mark.parametrize("given, name", [
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), (ml_dtypes.bfloat16, "bfloat16"),
    (np.dtype(ml_dtypes.bfloat16), "bfloat16"), ("float16", "float16"), (np.float16, "float16"),
    ("float32", "float32"), (np.float32, "float32"), (np.dtype("float32"), "float32"),
])
def test_supported_dtypes_resolve(given, name):
    assert payload_dtype(given).name == name


@pytest.mark.parametrize("given", ["float64", np.int8, "int32", object])
def test_unsupported_dtypes_raise_type_error_naming_the_choices(given):
    with pytest.raises(TypeError, match="bfloat16"):
        payload_dtype(given)
