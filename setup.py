"""Megatron-Hetero: Megatron-LM recipes on clusters of mixed accelerators and networks.

Install (the CPU torch wheel first, so nothing pulls a CUDA build on a CPU machine):
    pip install torch==2.13.0 && pip install --no-build-isolation -e '.[test]'
--no-build-isolation because the C++ extension hetero_comm._comm_ext builds against the
installed torch.
"""

from glob import glob

from setuptools import find_namespace_packages, setup
from torch.utils import cpp_extension


def comm_extension() -> cpp_extension.CppExtension:
    """hetero_comm._comm_ext, the C++ side of the `hetero` torch.distributed backend (csrc/).

    One source tree for every torch build: with a CUDA or ROCm torch and its toolkit
    present it is a CUDAExtension (ROCm sources are hipified by torch) with the
    stream/event code enabled by HETERO_WITH_CUDA; otherwise a CppExtension for CPU tensors.
    """
    import torch

    sources = ["csrc/hetero_backend.cpp", "csrc/module.cpp"]
    common = dict(depends=sorted(glob("csrc/*.hpp")))
    gpu_toolkit = (torch.version.cuda and cpp_extension.CUDA_HOME) or (
        torch.version.hip and cpp_extension.ROCM_HOME
    )
    if gpu_toolkit:
        return cpp_extension.CUDAExtension(
            "hetero_comm._comm_ext", sources, define_macros=[("HETERO_WITH_CUDA", "1")],
            extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"], "nvcc": ["-O2"]}, **common,
        )
    return cpp_extension.CppExtension(
        "hetero_comm._comm_ext", sources, extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"]}, **common
    )


setup(
    name="megatron-hetero",
    version="0.1.0",
    description="Heterogeneous-cluster planning and runtime over megatron-core",
    python_requires=">=3.10",
    # `megatron` is a namespace shared with the installed megatron-core: we ship only
    # megatron.hetero and never a megatron/__init__.py.
    packages=find_namespace_packages(include=["hetero", "hetero.*", "hetero_comm", "megatron.hetero",
                                              "megatron.hetero.*"]),
    py_modules=["pretrain_gpt"],
    # Megatron-LM's flag facts, read by hetero-plan and by megatron.hetero.flags at start-up.
    package_data={"hetero.spec": ["megatron_lm_flags*.json"], "megatron.hetero.flags": ["megatron_lm_reads*.json"]},
    ext_modules=[comm_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    install_requires=[
        # megatron-core 0.16.1's own floor, up to the newest release we test (the CPU set-up of
        # `make` pins 2.13.0). A GPU environment's torch (an NGC container's) is used as it is.
        "torch>=2.6,<2.14",
        # The releases Megatron-Hetero is tested with (megatron/hetero/core_version.py): 0.16.1
        # and 0.19.2, so an environment that has either keeps it. 0.19.2 asks for Python >= 3.12:
        # a fresh install on 3.11 resolves to 0.16.1, on 3.12+ to 0.19.2.
        "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,!=0.19.0,!=0.19.1,<=0.19.2",
        "pydantic>=2.5,<3",
        "PyYAML>=6.0",
        "numpy>=1.26",
        "matplotlib>=3.8",
        # megatron-core's checkpoint writer needs it but does not declare it (its forked
        # writer processes die without it and the save then waits forever).
        "psutil>=5.9",
        # --tensorboard-dir: torch's SummaryWriter writes the events, tensorboard reads them.
        "tensorboard>=2.14",
    ],
    extras_require={
        # Megatron-LM's tokenizers, each through its own package (an error names the one missing):
        # GPT2BPETokenizer and HuggingFaceTokenizer, SentencePiece/Llama2, TikTokenizer.
        "tokenizers": ["transformers>=4.40", "tokenizers>=0.15"],
        "sentencepiece": ["sentencepiece>=0.2"],
        "tiktoken": ["tiktoken>=0.7"],
        "wandb": ["wandb>=0.16"],
        # The tests build tiny tokenizers of every kind and log to W&B offline.
        # ...and check the import contracts of .importlinter (scipy: the estimate's rank agreement);
        # pytest-xdist runs the suite on every core.
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "transformers>=4.40",
                 "tokenizers>=0.15", "sentencepiece>=0.2", "tiktoken>=0.7", "wandb>=0.16", "import-linter>=2.1",
                 "scipy>=1.10"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": ["hetero-plan=hetero.cli:main", "hetero-launch=hetero.launch.commands:main"],
    },
)
