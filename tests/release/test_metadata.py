"""The eight pyproject files say what a package index and a careful user expect, and agree with
each other: one version, compatible-release pins on the core, the license file, absolute links."""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement

from .dists import (
    DISTRIBUTIONS,
    PLUGINS,
    REPO,
    URL,
    compatible_pin,
    core_version,
    links,
    pyproject,
    relative_links,
)

URL_LABELS = {"Homepage", "Documentation", "Changelog", "Issues"}


def test_core_version_has_one_home() -> None:
    import wtcore

    project = pyproject("wtcore")["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = pyproject("wtcore")["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "wtcore._version.__version__"
    assert wtcore.__version__ == core_version()


@pytest.mark.parametrize("dist", PLUGINS)
def test_plugins_match_and_pin_the_core(dist: str) -> None:
    project = pyproject(dist)["project"]
    assert project["version"] == core_version(), f"{dist}: bump it with the core"
    pins = [d for d in project["dependencies"] if Requirement(d).name == "wtcore"]
    assert pins == [compatible_pin(core_version())], project["dependencies"]


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_complete_metadata(dist: str) -> None:
    project = pyproject(dist)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "wtcore developers"}]
    assert project["keywords"] and project["classifiers"]
    assert "Programming Language :: Python :: 3 :: Only" in project["classifiers"]
    assert project["description"] and not project["description"].startswith("wtcore plugin: ")
    urls = project["urls"]
    assert set(urls) == URL_LABELS
    assert all(u.startswith(URL) for u in urls.values()), urls
    assert "importlib-metadata" not in " ".join(project["dependencies"])


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_distribution_carries_the_license(dist: str) -> None:
    """Setuptools only packs files inside the project directory: each plugin links to the root's."""
    license_file = REPO / DISTRIBUTIONS[dist] / "LICENSE"
    assert license_file.read_bytes() == (REPO / "LICENSE").read_bytes()
    assert "Apache License" in license_file.read_text()[:200]


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_readme_links_are_absolute_and_point_at_real_files(dist: str) -> None:
    readme = REPO / DISTRIBUTIONS[dist] / pyproject(dist)["project"]["readme"]
    text = readme.read_text()
    assert relative_links(text) == [], f"{readme}: relative links break on an index page"
    for target in links(text):
        prefix = f"{URL}/blob/main/"
        if target.startswith(prefix):
            path = target.removeprefix(prefix).split("#")[0]
            assert (REPO / path).exists(), f"{readme}: {target} names no file of the repository"


def test_relative_link_detection() -> None:
    text = "[a](docs/x.md) [b](https://x.org/y) [c](../../README.md)\n[d]: CHANGELOG.md\n"
    assert relative_links(text) == ["docs/x.md", "../../README.md", "CHANGELOG.md"]
