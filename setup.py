"""Build script for tag.

The protobuf modules (cluster topology, strategy) are generated from proto/*.proto at build time
by grpcio-tools; they are never written by hand or checked in.
"""
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def generate_protos(out_dir: str = os.path.join(ROOT, "tag", "_proto")) -> list:
    """Compile every proto/*.proto into OUT_DIR/*_pb2.py; returns the generated paths."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency (pyproject.toml)

    proto_dir = os.path.join(ROOT, "proto")
    os.makedirs(out_dir, exist_ok=True)
    init = os.path.join(out_dir, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Generated protobuf modules (built from proto/ by setup.py)."""\n')
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    outputs = []
    for name in sorted(os.listdir(proto_dir)):
        if not name.endswith(".proto"):
            continue
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out_dir}", name])
        if rc != 0:
            raise RuntimeError(f"protoc failed on proto/{name}")
        outputs.append(os.path.join(out_dir, name[: -len(".proto")] + "_pb2.py"))
    return outputs


class BuildPyWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


setup(
    name="tag",
    version="0.1.0",
    description="Topology-aware distributed-training compiler for TensorFlow",
    packages=find_packages(include=["tag", "tag.*", "tag_bench", "tag_bench.*"]),
    python_requires=">=3.11",
    install_requires=[
        # tf-keras (below) requires the `tensorflow` distribution itself, so we pin that one rather than
        # tensorflow-cpu: on a Linux host without a GPU it runs on the CPU; GPU hosts add CUDA with
        # `pip install tensorflow[and-cuda]==2.21.0`. 2.21 is the version this project is tested with.
        "tensorflow==2.21.0",
        # Keras 2: builds TF1 graph-mode models and ships the real CNN architectures for the zoo.
        "tf-keras==2.21.0",
        # 1.1.1 is the last DGL that imports on the TensorFlow backend without PyTorch
        # (1.1.2+ import torch; 2.x depends on it).
        "dgl==1.1.1",
        "numpy>=2.0",
        # the simulator's compiled kernel (tag/sim/kernel.py); 0.68.1 is the version tested (with numpy 2.4)
        "numba>=0.68.1",
        "scipy>=1.11",  # scipy.optimize.milp (HiGHS) for the compression selection
        "protobuf>=7.35",  # must be at least the gencode version of the build-time protoc
        "networkx>=3.0",
        "tqdm",
    ],
    # ruff and pylint (the linters .ci/run runs) are pinned: a new release's rules would fail CI unasked
    # scikit-learn: examples/train_digits.py, scripts/bench_keras_fit.py and the test that runs a short version of
    # it (tests/test_keras.py) train on its real digits data set, shipped as a file in its package (no download at
    # run time); tag itself does not import it, so it is not an install requirement.
    extras_require={"test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis", "grpcio-tools==1.85.1",
                             "ruff==0.17.6", "pylint==4.1.5", "scikit-learn"],
                    "examples": ["scikit-learn"]},
    entry_points={
        "console_scripts": [
            "tag-topo=tag.cli.topo:main",
            "tag-deploy=tag.cli.deploy:main",
            "tag-worker=tag.cli.worker:main",
            "tag-profile=tag.cli.profile:main",
        ]
    },
    package_data={"tag": ["_proto/*.py", "cost/data/*.json", "gnn/*.npz", "gnn/TRAINING.md"],
                  "tag_bench": ["testbed_recipe.json"]},
    cmdclass={"build_py": BuildPyWithProtos},
)
