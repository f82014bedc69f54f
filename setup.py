"""Megatron-Hetero: Megatron-LM recipes on clusters of mixed accelerators and networks.

Install (the CPU torch wheel first, so nothing pulls a CUDA build on a CPU machine):
    pip install torch==2.13.0 && pip install --no-build-isolation -e '.[test]'
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-hetero",
    version="0.1.0",
    description="Heterogeneous-cluster planning and runtime over megatron-core",
    python_requires=">=3.10",
    # `megatron` is a namespace shared with the installed megatron-core: we ship only
    # megatron.hetero and never a megatron/__init__.py.
    packages=find_namespace_packages(include=["hetero", "hetero.*", "megatron.hetero", "megatron.hetero.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "pydantic>=2.5,<3",
        "PyYAML>=6.0",
        "numpy>=1.26",
        "matplotlib>=3.8",
        # megatron-core's checkpoint writer needs it but does not declare it (its forked
        # writer processes die without it and the save then waits forever).
        "psutil>=5.9",
    ],
    extras_require={
        "test": ["pytest>=8.0", "pytest-timeout>=2.3"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": ["hetero-plan=hetero.cli:main", "hetero-launch=hetero.launch:main"],
    },
)
