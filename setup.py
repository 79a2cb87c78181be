"""Package discovery for the folders that install under `deepinfer.` (DESIGN.md, Layout).

pyproject's `package-dir` alone is not enough: package discovery sees `recipe`, not
`deepinfer.recipe`, so the mapped folders were left out and the editable finder could not import
them. This lists them (and their subpackages) explicitly.
"""

from setuptools import find_packages, setup

MAPPED = {"deepinfer.kernels": "kernels", "deepinfer.recipe": "recipe", "deepinfer.ensemble": "ensemble"}

packages = find_packages(include=["deepinfer", "deepinfer.*"])
package_dir = {"deepinfer": "deepinfer"}
for name, folder in MAPPED.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
