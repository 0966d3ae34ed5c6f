"""Packaging shim: recipes/ lives at the repository root, where users look for it, and ships inside
the package as suite/recipes/. pyproject.toml cannot add a package-dir-mapped package to its
`packages.find` result, so the package list is built here; everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["suite", "suite.*"]), "suite.recipes"],
    package_dir={"suite.recipes": "recipes"},
)
