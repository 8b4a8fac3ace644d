"""The compared rows as flat records and as a pandas DataFrame: one record per row of a compare, with both
sides' records, the statistics' differences, the tensor metrics and whether it is the first divergence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_msprobe.compare.diagnosis import Divergence
from pytest_msprobe.compare.judging import STAT_NAMES, ApiResult, RowResult, row_metric

# the tensor metrics of a row, as row_records names its columns (TensorMetrics' own field names)
_TENSOR_COLUMNS = (
    "cosine",
    "euc_dist",
    "max_abs_err",
    "max_rel_err",
    "one_thousandth",
    "five_thousandths",
    "rel_l2",
    "scaled_max_abs",
)

# the columns of CompareResult.row_records / to_pandas, in order
ROW_COLUMNS = (
    *("step", "rank", "order", "api", "bench_api", "direction", "api_status", "row", "bench_row", "role"),
    *("status", "error", "allowed", "metric", "reason", "problem", "first_divergence"),
    *(
        f"{side}_{item}"
        for side in ("target", "baseline")
        for item in ("type", "dtype", "shape", "max", "min", "mean", "norm", "md5")
    ),
    *(
        f"stat_{stat}_{kind}"
        for stat in ("max", "min", "mean", "norm")
        for kind in ("diff", "rel_err", "scaled_err")
    ),
    *_TENSOR_COLUMNS,
    "msprobe_accuracy",
)


def row_records(
    rows: Sequence[RowResult], apis: Sequence[ApiResult], fd: Divergence | None
) -> list[dict[str, Any]]:
    """One record per compared row of a compare (its rows, its calls, its first divergence), its keys
    :data:`ROW_COLUMNS` (``None`` where a value is not there)."""
    records = []
    for index, row in enumerate(rows):
        api = apis[row.api_index]
        record: dict[str, Any] = {
            "step": api.step,
            "rank": api.rank,
            "order": api.order,
            "api": api.api,
            "bench_api": api.bench_api,
            "direction": api.direction,
            "api_status": api.status,
            "row": row.row,
            "bench_row": row.bench_row,
            "role": row.role,
            "status": row.status,
            "error": row.error,
            "allowed": row.allowed,
            "metric": row_metric(row),
            "reason": row.reason,
            "problem": row.problem,
            "first_divergence": fd is not None and fd.row_index == index,
        }
        for side, leaf in (("target", row.target), ("baseline", row.baseline)):
            record[f"{side}_type"] = None if leaf is None else leaf.type
            record[f"{side}_dtype"] = None if leaf is None else leaf.dtype
            record[f"{side}_shape"] = None if leaf is None or leaf.shape is None else tuple(leaf.shape)
            for name, value in zip(STAT_NAMES, leaf.stats if leaf is not None else (None,) * 4):
                record[f"{side}_{name.lower()}"] = value
            record[f"{side}_md5"] = None if leaf is None else leaf.md5
        stat = row.stat
        for i, name in enumerate(STAT_NAMES):
            record[f"stat_{name.lower()}_diff"] = None if stat is None else stat.diff[i]
            record[f"stat_{name.lower()}_rel_err"] = None if stat is None else stat.rel[i]
            record[f"stat_{name.lower()}_scaled_err"] = None if stat is None else stat.scaled[i]
        t = row.tensor
        for name in _TENSOR_COLUMNS:
            record[name] = None if t is None else getattr(t, name)
        record["msprobe_accuracy"] = row.msprobe_accuracy
        records.append(record)
    return records


def to_pandas(rows: Sequence[RowResult], apis: Sequence[ApiResult], fd: Divergence | None) -> Any:
    """:func:`row_records` as a pandas DataFrame with the columns :data:`ROW_COLUMNS`, in order."""
    try:
        import pandas
    except ImportError as exc:
        raise ImportError(
            "CompareResult.to_pandas() needs pandas: pip install 'pytest-msprobe[pandas]'"
        ) from exc
    return pandas.DataFrame.from_records(row_records(rows, apis, fd), columns=ROW_COLUMNS)
