"""``layers=`` of a pooled KVzip (:mod:`kvsplice.select.pooled_layers`): a layer, a range or a band of the depth,
written back as given, mapped to a model's layers and checked against its depth."""

import pytest

from kvsplice.select.pooled_layers import PooledLayers


@pytest.mark.parametrize("given, text, span30", [(3, "3-3", (3, 3)), ("15-19", "15-19", (15, 19)),
                                                 ("50%-67%", "50%-67%", (15, 19)), ("0%-100%", "0%-100%", (0, 29))])
def test_each_form_reads_back_and_maps_to_layers(given, text, span30):
    layers = PooledLayers.parse(given)
    assert str(layers) == text and PooledLayers.parse(str(layers)) == layers
    assert layers.span(30) == span30


def test_a_range_past_the_models_depth_is_refused_naming_its_layers():
    assert PooledLayers.parse("2-4").span(5) == (2, 4)
    with pytest.raises(ValueError, match="the model has layers 0-3"):
        PooledLayers.parse("2-4").span(4)
    with pytest.raises(ValueError, match="holds none of the model's 4 layers"):
        PooledLayers.parse("0%-10%").span(4)
