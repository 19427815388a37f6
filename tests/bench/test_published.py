"""tag_bench.published: the data files of published throughput and the ResNets it builds itself."""
import os

from tag_bench import published as bp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FRESH = os.path.join(REPO, "data", "published_throughput_fresh.csv")


def test_the_fresh_held_out_rows_are_validation_rows_the_fit_file_does_not_hold():
    fresh, fit_file = bp.read_rows(FRESH), bp.read_rows(bp.DATA)
    assert len(fresh) >= 20 and all(r["split"] == "validation" for r in fresh)
    # a model no row of the fitted file has, built by the bench itself
    assert {r["model"] for r in fresh} == {"resnet152"} and "resnet152" in bp.RESNETS
    assert not {r["model"] for r in fit_file} & {r["model"] for r in fresh}
    assert not {r["id"] for r in fit_file} & {r["id"] for r in fresh}
    mixed = [r for r in fresh if r["precision"] != "fp32"]
    assert len(mixed) >= 20 and len({r["gpu"] for r in mixed}) >= 2


def test_resnet_stages_set_the_number_of_bottleneck_convolutions():
    def convs(stages):
        gd = bp._resnet_graph_def(2, stride_in_3x3=False, stages=stages)
        return sum(n.op == "Conv2D" for n in gd.node)

    # the stem, three convolutions per block and one projection per stage
    assert convs((1, 2, 1, 1)) == 1 + 3 * 5 + 4
    assert convs((1, 1, 1, 1)) == 1 + 3 * 4 + 4
