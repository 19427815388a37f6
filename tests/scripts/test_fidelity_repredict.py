"""scripts/fidelity_repredict.py's options (no saved run needed)."""
import pytest

from helpers import load_script


def test_repredict_network_overrides_name_known_fields_only():
    """``fidelity_repredict --network KEY=VALUE``: known NetworkProfile fields become floats; an unknown field,
    a missing '=' or a value that is not a number is refused with the option named."""
    network_overrides = load_script("fidelity_repredict").network_overrides
    assert network_overrides(["collective_latency_s=0.00105", "per_tensor_s=7e-5"]) == {
        "collective_latency_s": 0.00105, "per_tensor_s": 7e-5}
    assert network_overrides([]) == {}
    for bad in ("latency=1", "collective_latency_s", "collective_latency_s=fast"):
        with pytest.raises(ValueError, match="--network"):
            network_overrides([bad])
