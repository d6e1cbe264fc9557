"""Map the root folders policies/, plugin/, billing/, sim/ to kvroute.* (sub-packages found automatically)."""

from setuptools import find_packages, setup

CODE_DIRS = ("policies", "plugin", "billing", "sim")

packages = []
for folder in CODE_DIRS:
    packages.append(f"kvroute.{folder}")
    packages.extend(f"kvroute.{folder}.{sub}" for sub in find_packages(where=folder))

setup(packages=packages, package_dir={f"kvroute.{folder}": folder for folder in CODE_DIRS})
