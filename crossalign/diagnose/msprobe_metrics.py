"""msprobe's compare metrics and pass rules, computed as msprobe 26.2.0's compare computes them.

msprobe calls the two sides NPU (``n_value``, here the MindSpore side) and bench (``b_value``, the Megatron side).
Each function cites the msprobe source it follows (``msprobe/core/compare/`` in site-packages); a test holds every
number against msprobe's own functions on real dumps. Reimplemented rather than imported so that ``crossalign
diagnose`` needs no msprobe where it only reads dumps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# msprobe/core/common/const.py:870-871 (THOUSAND_RATIO_THRESHOLD, FIVE_THOUSAND_RATIO_THRESHOLD)
ONE_THOUSANDTH, FIVE_THOUSANDTHS = 0.001, 0.005
# msprobe/core/common/const.py:901-905 (COS_THRESHOLD, MAX_ABS_ERR_THRESHOLD, COS_MAX_THRESHOLD,
# MAX_ABS_ERR_MAX_THRESHOLD)
COS_THRESHOLD, MAX_ABS_ERR_THRESHOLD, COS_MAX_THRESHOLD, MAX_ABS_ERR_MAX_THRESHOLD = 0.99, 0.001, 0.9, 1.0
# msprobe/core/common/const.py:687 (MAGNITUDE) and :704 (EPSILON): the statistics rule
MAGNITUDE, EPSILON = 0.5, 1e-10
# msprobe/core/common/const.py:873 (COSINE_THRESHOLD): cosines above it are rounded to 6 places
COSINE_ROUND_ABOVE = 0.9999


@dataclass(frozen=True)
class TensorMetrics:
    """msprobe's five metrics of one tensor pair; None where msprobe writes 'unsupported' or 'NaN'."""

    cosine: float | None
    max_abs_err: float | None
    max_relative_err: float | None
    one_thousandth_err_ratio: float | None
    five_thousandths_err_ratio: float | None

    @property
    def accuracy_reached(self) -> str:
        return check_accuracy(self.cosine, self.max_abs_err)

    def as_dict(self) -> dict[str, float | None]:
        return {"Cosine": self.cosine, "MaxAbsErr": self.max_abs_err, "MaxRelativeErr": self.max_relative_err,
                "One Thousandth Err Ratio": self.one_thousandth_err_ratio,
                "Five Thousandths Err Ratio": self.five_thousandths_err_ratio}


def format_value(value: float) -> float:
    """msprobe/core/common/utils.py:307-308: twelve decimal places."""
    return float("{:.12f}".format(value))


def relative_errors(n_value: np.ndarray, b_value: np.ndarray) -> np.ndarray:
    """|n - b| / |b| elementwise, with machine epsilon added to both where b is 0
    (msprobe/core/compare/utils.py:1252-1272, get_relative_err)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n_value = n_value if n_value.dtype.kind == "f" else n_value.astype(float)
        b_value = b_value if b_value.dtype.kind == "f" else b_value.astype(float)
        zero_mask = b_value == 0
        result_type = np.result_type(n_value, b_value, np.float32)
        n, b = n_value.astype(result_type), b_value.astype(result_type)
        epsilon = np.finfo(result_type).eps
        n[zero_mask] += epsilon
        b[zero_mask] += epsilon
        return np.abs(np.divide(n - b, b))


def cosine(n_value: np.ndarray, b_value: np.ndarray) -> float | None:
    """msprobe/core/compare/algorithm/builtin_algorithm/alg_cosine_similarity.py:28-52 (0-d and one-element tensors
    are 'unsupported', compare/utils.py:1228-1237; an all-zero side is 'NaN')."""
    if n_value.ndim == 0 or b_value.ndim == 0 or n_value.size <= 1 or b_value.size <= 1:
        return None
    n, b = n_value.reshape(-1).astype(float), b_value.reshape(-1).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        num = np.dot(n, b)
        a_norm, b_norm = np.linalg.norm(n), np.linalg.norm(b)
        eps = np.finfo(float).eps  # const.py:103 FLOAT_EPSILON
        if a_norm <= eps and b_norm <= eps:
            return 1.0
        if a_norm <= eps or b_norm <= eps:
            return None
        cos = num / (a_norm * b_norm)
    if np.isnan(cos):
        return None
    result = format_value(cos)
    return round(result, 6) if result > COSINE_ROUND_ABOVE else result


def tensor_metrics(n_value: np.ndarray, b_value: np.ndarray) -> TensorMetrics:
    """The five metrics of two same-shaped arrays (the shape check is the caller's, as msprobe's
    ``ValidateTensor._check_shape``, npy_compare.py:192-208)."""
    n_value, b_value = np.asarray(n_value), np.asarray(b_value)
    if n_value.size == 0:
        return TensorMetrics(None, None, None, None, None)
    flat_n = n_value.reshape(-1).astype(float) if n_value.shape else n_value.astype(float)
    flat_b = b_value.reshape(-1).astype(float) if b_value.shape else b_value.astype(float)
    # alg_max_absolute_error.py:27-32
    max_abs = np.max(np.abs(flat_n - flat_b))
    max_abs = None if np.isnan(max_abs) else format_value(max_abs)
    # alg_max_relative_error.py:27-35
    relative = relative_errors(n_value, b_value)
    max_rel = np.max(np.abs(relative))
    max_rel = None if np.isnan(max_rel) else format_value(max_rel)
    ratios: list[float | None] = []
    for threshold in (ONE_THOUSANDTH, FIVE_THOUSANDTHS):  # compare/utils.py:1275-1285, calc_relative_err_ratio
        if n_value.ndim == 0 or b_value.ndim == 0:
            ratios.append(None)
        else:
            ratios.append(format_value(np.sum(relative < threshold) / relative.size))
    return TensorMetrics(cosine(n_value, b_value), max_abs, max_rel, *ratios)


def check_accuracy(cos: float | None, max_abs_err: float | None) -> str:
    """msprobe's 'Accuracy Reached or Not' of a tensor pair (msprobe/core/compare/multiprocessing_compute.py:85-101):
    'No' where cosine < 0.99 and MaxAbsErr > 0.001, or cosine < 0.9, or MaxAbsErr > 1; 'N/A' where msprobe cannot
    compute them (its 'No' for N/A values is kept: an uncomputable cosine of a non-scalar is not a pass)."""
    if cos is None or max_abs_err is None:
        return "N/A"
    if cos < COS_THRESHOLD and max_abs_err > MAX_ABS_ERR_THRESHOLD:
        return "No"
    if cos < COS_MAX_THRESHOLD or max_abs_err > MAX_ABS_ERR_MAX_THRESHOLD:
        return "No"
    return "Yes"


def statistics_warning(npu: dict[str, float | None], bench: dict[str, float | None]) -> bool:
    """msprobe's statistics-mode warning (msprobe/core/compare/utils.py:436-459, get_rela_diff_summary_mode): any of
    Max, Min, Mean, Norm with |npu - bench| / (max(|npu|, |bench|) + 1e-10) > 0.5."""
    for stat in ("Max", "Min", "Mean", "Norm"):
        n, b = npu.get(stat), bench.get(stat)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (n, b)):
            continue
        diff = n - b
        if math.isnan(diff):
            continue
        if abs(diff) / (max(abs(n), abs(b)) + EPSILON) > MAGNITUDE:
            return True
    return False


def md5_result(npu: str | None, bench: str | None) -> str:
    """msprobe's md5-mode result (msprobe/core/compare/acc_compare.py:1621-1624): 'pass' when equal, else 'diff'."""
    return "pass" if npu is not None and npu == bench else "diff"
