"""cost_models/coefficients.py: calibration coefficients (YAML round trip, errors, defaults)."""
from __future__ import annotations

import pytest

from cost_models.coefficients import Coefficients, CoefficientsError


def test_coefficients_yaml_round_trip(tmp_path):
    c = Coefficients(gemm_efficiency_scale=0.9, tp_overlap=0.5, memory_overhead_bytes=1e9)
    path = tmp_path / "cal.yaml"
    c.save(path, meta={"fitted_on": "unit test"})
    assert Coefficients.load(path) == c
    assert Coefficients.from_dict(c.to_dict()) == c
    assert Coefficients() == Coefficients.from_dict({})


@pytest.mark.parametrize("d,key", [({"gemm_scale": 1.0}, "gemm_scale"), ({"tp_overlap": 2.0}, "tp_overlap"),
                                   ({"gemm_efficiency_scale": 0}, "gemm_efficiency_scale"),
                                   ({"dp_overlap": "high"}, "dp_overlap"), ({"ep_imbalance": 0.5}, "ep_imbalance")])
def test_coefficients_errors_name_the_key(d, key):
    with pytest.raises(CoefficientsError, match=key):
        Coefficients.from_dict(d)


def test_default_coefficients_mean_no_correction():
    c = Coefficients()
    for k, v in c.to_dict().items():
        if k.endswith("_scale") or k == "ep_imbalance":
            assert v == 1.0, k
    assert c.tp_overlap == 0.0 and c.step_overhead_s == 0.0 and c.memory_overhead_bytes == 0.0
