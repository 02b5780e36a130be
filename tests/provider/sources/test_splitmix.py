"""The one SplitMix64 (services/provider/sources/splitmix.py) that mock labels, image augmentation and
pipeline stages draw from: the reference generator's outputs, and numbers that depend on the counter
alone (the same whichever batch asks)."""

import numpy as np

from services.provider.sources.splitmix import GAMMA, mix, uniforms


def test_mix_is_splitmix64_as_its_reference_implementation_outputs_it():
    # SplitMix64 seeded 0 (Vigna's splitmix64.c): its first outputs are mix(n * gamma) for n = 1, 2, 3
    states = np.arange(1, 4, dtype=np.uint64) * GAMMA
    assert [hex(v) for v in mix(states).tolist()] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f"]


def test_uniforms_depend_on_the_counter_alone_and_lie_in_the_unit_interval():
    key = np.uint64(2024)
    whole = uniforms(key, np.arange(1000, dtype=np.uint64))
    part = uniforms(key, np.array([999, 3, 500], np.uint64))
    assert part.tolist() == [whole[999], whole[3], whole[500]]
    assert whole.min() >= 0.0 and whole.max() < 1.0 and 0.45 < whole.mean() < 0.55
    assert not np.array_equal(whole, uniforms(np.uint64(2025), np.arange(1000, dtype=np.uint64)))
