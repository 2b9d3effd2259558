"""What installing takes: the README's set-up (two commands, the first installing the lean
``demo`` extra) and the ``s3-server`` extra (a local S3 whose boto3 fits the s3fs installed)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_sets_up_with_two_commands_the_first_installing_the_lean_demo_extra():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = setup.split("```bash\n")[1:]
    assert len(commands) == 2
    assert "pip install '.[demo]'" in commands[0] and "attrindex demo" in commands[0]
    assert "Java 17+" in setup and "GB of memory" in setup
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    demo = " ".join(extras["demo"])
    assert "pyspark[sql]" in demo and "pandas" in demo  # pyspark[sql] brings pyarrow
    for tool in ("pytest", "hypothesis", "moto", "mypy", "matplotlib", "lmdb", "tqdm"):
        assert tool not in demo


def test_a_local_s3_installs_with_one_extra_whose_boto3_fits_s3fs():
    # `pip install '.[s3]' 'moto[server]'` does not resolve: pip takes the newest boto3 (moto's),
    # whose botocore the aiobotocore under s3fs refuses, and backtracks s3fs instead. The
    # s3-server extra pins boto3 into the botocore range of the aiobotocore installed here.
    import importlib.metadata

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {Requirement(r).name: Requirement(r) for r in extras["s3-server"]}
    assert {"attrindex", "moto", "boto3", "s3fs"} <= set(wanted) and "server" in wanted["moto"].extras
    botocore = next(Requirement(r) for r in importlib.metadata.requires("aiobotocore")
                    if Requirement(r).name == "botocore" and not Requirement(r).marker)
    boto3_pin = wanted["boto3"].specifier
    lowest = next(s.version for s in boto3_pin if s.operator == ">=")
    assert botocore.specifier.contains(lowest), (boto3_pin, botocore)  # boto3 X needs botocore X on
    assert importlib.metadata.version("boto3") in boto3_pin  # what the test extra resolved to fits too
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    assert "pip install '.[s3-server]'" in guide and "moto_server -H 127.0.0.1" in guide
