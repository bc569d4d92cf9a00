"""The package map, the one thing pyproject.toml cannot say: the folders at the repository root
(``engine/``, ``service/``, ...) install under the single import name ``stencil`` (``stencil.engine``,
``stencil.service``, ...), so the wheel claims ``stencil`` and nothing else in site-packages
(docs/architecture.md, "One import name"). Everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

# The folders that become stencil.<name>; the layout test (tests/test_layout.py) checks the wheel.
FOLDERS = ("engine", "service", "grammar", "kernels", "schemas", "benchmarks")

package_dir = {"stencil": "stencil", **{f"stencil.{f}": f for f in FOLDERS}}
# Namespace packages too: the data folders (benchmarks/data, kernels/csrc) are importable names to
# setuptools, which warns about any it is not given.
packages = ["stencil"] + [f"stencil.{f}{'.' + sub if sub else ''}"
                          for f in FOLDERS for sub in ["", *find_namespace_packages(f, exclude=["*__pycache__*"])]]

setup(package_dir=package_dir, packages=packages)
