"""`medserve run` without running a container: its command line, the argv it builds for podman/docker, and the
requests it refuses before touching the engine."""

from __future__ import annotations

import base64
import inspect as pyinspect
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from holoscan_cli.common import dockerutils

from medserve.cli import main as cli_main
from medserve.packaging import engine, registry
from medserve.packaging import run as map_run
from medserve.errors import PackagingError
from medserve.packaging.run import RunRequest, run_argv, ulimits
from medserve.stopping import Terminated, termination_as_interrupt

APP_JSON = {"workingDirectory": "/var/holoscan", "input": {"path": "input/"}, "output": {"path": "output/"},
            "environment": {"HOLOSCAN_INPUT_PATH": "input/", "HOLOSCAN_OUTPUT_PATH": "output/"}}
PKG_JSON = {"resources": {"cpu": 1, "gpu": 0}}


@pytest.fixture
def no_engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`podman` as the engine, and any image reads as a MAP: records the requests that got that far."""
    reached: list[str] = []
    monkeypatch.setattr(engine, "pick", lambda choice, daemonless: "podman")

    def read_manifests(image: str, tool: str) -> tuple[dict, dict]:
        reached.append(image)
        return APP_JSON, PKG_JSON

    monkeypatch.setattr(map_run, "read_manifests", read_manifests)
    return reached


def test_app_arguments_after_double_dash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[RunRequest] = []
    monkeypatch.setattr(map_run, "run", lambda request: seen.append(request) or 0)
    (tmp_path / "in").mkdir()
    assert cli_main(["run", "img:1", "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--", "3"]) == 0
    assert cli_main(["run", "img:1", "--gpus", "all", "--", "-x", "--flag", "-o", "y"]) == 0
    assert cli_main(["run", "img:1", "-i", str(tmp_path / "in")]) == 0
    assert [(r.image, r.extra_args) for r in seen] == [("img:1", ["3"]), ("img:1", ["-x", "--flag", "-o", "y"]),
                                                       ("img:1", [])]
    assert seen[0].output == tmp_path / "out" and seen[1].gpus == "all" and seen[1].output is None


def test_ulimits_and_environment_are_the_official_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    source = pyinspect.getsource(dockerutils.docker_run)
    assert '"memlock=-1"' in source and '"stack=67108864"' in source and "UCX_CM_USE_ALL_DEVICES" in source
    assert ulimits("docker") == ["memlock=-1", "stack=67108864"]
    monkeypatch.setattr(map_run, "_can_raise_limits", lambda: True)
    argv = run_argv(RunRequest("img:1", None, None), "podman", APP_JSON, PKG_JSON)
    limits = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--ulimit"]
    assert limits == ["memlock=-1", "stack=67108864"]  # no nproc cap: monai-deploy run sets none
    assert "UCX_CM_USE_ALL_DEVICES=n" in argv


def test_ulimits_without_cap_sys_resource_never_exceed_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where runc cannot raise limits (CI sandboxes), each limit is at most this process's own."""
    monkeypatch.setattr(map_run, "_can_raise_limits", lambda: False)
    fake = {resource.RLIMIT_MEMLOCK: (65536, 8388608), resource.RLIMIT_STACK: (8388608, resource.RLIM_INFINITY),
            resource.RLIMIT_NOFILE: (1024, 20000), resource.RLIMIT_NPROC: (96362, 96362)}
    monkeypatch.setattr(map_run.resource, "getrlimit", fake.__getitem__)
    monkeypatch.setattr(map_run, "_pid_max", lambda: 32768)
    assert ulimits("podman") == ["memlock=8388608:8388608", "stack=67108864:67108864", "nofile=1024:20000",
                                 "nproc=32768:32768"]


@pytest.mark.parametrize(("command", "image", "expected"), [
    ("run", "127.0.0.1:5917/Probe/Bundle-Seg:0.1.0", "image '127.0.0.1:5917/Probe/Bundle-Seg:0.1.0': repository "
                                                     "'Probe/Bundle-Seg' is not a valid name"),
    ("inspect", "", "the image reference is empty; expected an image ID or [HOST[:PORT]/]REPO[:TAG][@DIGEST]"),
    ("run", "x@sha256:zz", "image 'x@sha256:zz': digest 'sha256:zz' is not ALGORITHM:HEX"),
])
def test_a_malformed_image_is_refused_before_the_engine_is_asked(no_engine_calls: list, capsys: pytest.CaptureFixture,
                                                                 command: str, image: str, expected: str) -> None:
    """podman's own refusals named neither the reference nor the rule ("repository name must be lowercase",
    "at least one component"); push checked references itself, run and inspect did not."""
    assert cli_main([command, image]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert no_engine_calls == []


def test_image_ids_digests_and_tags_pass_the_reference_check() -> None:
    for image in ("localhost/bundle-seg:0.1.0", "ghcr.io/org/app", "def9e0abd11c", "sha256:" + "b" * 64,
                  "docker://ghcr.io/org/app:1", "ghcr.io/org/app:1@sha256:" + "a" * 64,
                  "MYREG/app:1"):  # a capital letter makes the first part a registry host, as in Docker's grammar
        assert registry.image_reference(image) == image


@pytest.mark.parametrize(("value", "expected"), [("-1", "--gpus -1: expected 'all', a number of GPUs"),
                                                  ("two", "--gpus two: expected"), ("0,x", "--gpus 0,x: expected"),
                                                  ("device=", "--gpus device=: expected"),
                                                  ("1,1", "--gpus 1,1: a device is listed twice")])
def test_bad_gpus_is_one_error_line(no_engine_calls: list, capsys: pytest.CaptureFixture, value: str,
                                    expected: str) -> None:
    assert cli_main(["run", "img:1", "--gpus", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert no_engine_calls == []  # refused before the image is even looked at


def test_gpu_count_on_a_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(map_run, "host_gpu_count", lambda: 2)
    docker = run_argv(RunRequest("img:1", None, None, gpus="1"), "docker", APP_JSON, PKG_JSON)
    assert docker[docker.index("--gpus") + 1] == '"device=0"'
    podman = run_argv(RunRequest("img:1", None, None, gpus="all"), "podman", APP_JSON, PKG_JSON)
    assert [podman[i + 1] for i, arg in enumerate(podman) if arg == "--device"] == ["nvidia.com/gpu=0",
                                                                                    "nvidia.com/gpu=1"]
    for tool in ("docker", "podman"):  # --gpus 0: the CPU, though the package asks for a GPU and the host has two
        cpu = run_argv(RunRequest("img:1", None, None, gpus="0"), tool, APP_JSON, {"resources": {"gpu": 1}})
        assert "--gpus" not in cpu and "--device" not in cpu, cpu


def test_gpus_on_a_host_without_them_run_on_the_cpu_saying_who_asked(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(map_run, "host_gpu_count", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="medserve.packaging.run"):
        for gpus, pkg in (("0,1", PKG_JSON), ("all", PKG_JSON), (None, {"resources": {"gpu": 1}})):
            argv = run_argv(RunRequest("img:1", None, None, gpus=gpus), "docker", APP_JSON, pkg)
            assert "--gpus" not in argv
    assert caplog.messages == ["--gpus 0,1 asks for GPUs and this host has none: running on CPU",
                               "--gpus all asks for GPUs and this host has none: running on CPU",
                               "the package asks for 1 GPU(s) and this host has none: running on CPU"]


def test_gpu_device_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device indices pick those GPUs (docker's `--gpus '"device=0,2"'`, podman's CDI devices); an index the host
    lacks is an error naming it."""
    monkeypatch.setattr(map_run, "host_gpu_count", lambda: 4)
    docker = run_argv(RunRequest("img:1", None, None, gpus="0,2"), "docker", APP_JSON, PKG_JSON)
    assert docker[docker.index("--gpus") + 1] == '"device=0,2"'
    podman = run_argv(RunRequest("img:1", None, None, gpus="device=3"), "podman", APP_JSON, PKG_JSON)
    assert [podman[i + 1] for i, arg in enumerate(podman) if arg == "--device"] == ["nvidia.com/gpu=3"]
    with pytest.raises(PackagingError, match=r"GPU device\(s\) 4, 7 requested; this host has 4 \(devices 0-3\)"):
        run_argv(RunRequest("img:1", None, None, gpus="1,4,7"), "docker", APP_JSON, PKG_JSON)


@pytest.mark.parametrize(("resources", "size"), [({}, "1073741824"), ({"sharedMemory": "1.5Gi"}, "1610612736"),
                                                ({"sharedMemory": "1Gi", "fragments": None}, "1073741824"),
                                                ({"sharedMemory": "512MB"}, "512000000"),
                                                ({"sharedMemory": "1g", "fragments": {"f": {"sharedMemory": "2Gi"}}},
                                                 "2147483648")])
def test_shared_memory_in_bytes_as_monai_deploy_reads_it(resources: dict, size: str) -> None:
    """pkg.json's sharedMemory becomes --shm-size in bytes with holoscan-cli's units (MB decimal, Mi binary),
    which the engines' own "m"/"g" (binary) would not keep; none named is holoscan-cli's 1 GiB, not the
    engines' 64 MB."""
    argv = run_argv(RunRequest("img:1", None, None), "podman", APP_JSON, {"resources": {"cpu": 1, **resources}})
    assert argv[argv.index("--shm-size") + 1] == size


@pytest.mark.parametrize("value", ["lots", "1.2.3Gi", float("inf"), -1, "0Mi"])
def test_unreadable_shared_memory_is_one_error_naming_the_field(value: str | float) -> None:
    """Also for a MAP packaged by another tool, whose pkg.json holds what our app.yaml checks would refuse
    (Infinity was an OverflowError traceback; -1 and 0 became --shm-size 0, no limit under podman)."""
    with pytest.raises(PackagingError, match=r"^pkg.json resources.sharedMemory: .*Expected a size such as"):
        run_argv(RunRequest("img:1", None, None), "podman", APP_JSON, {"resources": {"sharedMemory": value}})


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_output_that_is_or_is_under_a_file(no_engine_calls: list, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           where: str) -> None:
    (tmp_path / "file").write_text("x")
    assert cli_main(["run", "img:1", "-o", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: output folder {tmp_path / where}: {tmp_path / 'file'} is a file; expected a folder " \
                  "(or a path to create one)\n"
    assert no_engine_calls == []


def test_output_created_only_once_the_image_is_a_map(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from medserve.errors import PackagingError

    monkeypatch.setattr(engine, "pick", lambda choice, daemonless: "podman")

    def no_image(image: str, tool: str) -> tuple[dict, dict]:
        raise PackagingError(f"reading manifests of {image} failed")

    monkeypatch.setattr(map_run, "read_manifests", no_image)
    assert cli_main(["run", "absent:1", "-o", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_remote_image_pulled_with_credentials_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """create/run would pull a missing registry image without any credentials: medserve pulls it first."""
    pulled: list[tuple[str, str]] = []
    monkeypatch.setattr(registry, "pull", lambda image, choice: pulled.append((image, choice)) or "id")
    monkeypatch.setattr(map_run, "_image_present", lambda image, tool: image.endswith(":here"))
    for image in ("127.0.0.1:5000/m/toy:1", "ghcr.io/o/toy:here", "localhost/toy:here", "toy:1"):
        map_run.ensure_image(image, "podman")
    assert pulled == [("127.0.0.1:5000/m/toy:1", "podman")]


def test_the_manifests_container_is_removed_when_its_creation_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the engine creates the container that the manifests are copied from: the engine may have
    created it already, so it is removed by the name it was given."""
    created: list[str] = []
    removed: list[list[str]] = []

    def interrupted_create(argv: list[str], what: str, **kwargs: object) -> None:
        created.append(argv[argv.index("--name") + 1])
        raise KeyboardInterrupt

    monkeypatch.setattr(map_run, "ensure_image", lambda image, tool: None)
    monkeypatch.setattr(engine, "run", interrupted_create)
    monkeypatch.setattr(map_run.subprocess, "run",
                        lambda argv, **kwargs: removed.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""))
    with pytest.raises(KeyboardInterrupt):
        map_run.read_manifests("localhost/seg:1", "podman")
    assert len(created) == 1 and created[0].startswith("medserve-manifest-")
    assert removed and removed[-1][-3:] == ["rm", "-f", created[0]]


def test_the_manifests_container_is_removed_again_while_the_engine_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `podman cp` killed by Ctrl-C can leave the container locked: one `rm -f` failed and left it "Removing"
    (1 run in 5 of a probe); the removal is retried until it succeeds or the container is gone."""
    answers = iter([(125, "Error: container state improper"), (125, "Error: container state improper"), (0, "")])
    calls: list[list[str]] = []

    def engine_rm(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(argv)
        code, stderr = next(answers)
        return subprocess.CompletedProcess(argv, code, "", stderr)

    monkeypatch.setattr(map_run.subprocess, "run", engine_rm)
    monkeypatch.setattr(map_run.time, "sleep", lambda seconds: None)
    map_run._remove_until_gone("podman", "medserve-manifest-x")
    assert [argv[-3:] for argv in calls] == [["rm", "-f", "medserve-manifest-x"]] * 3
    calls.clear()
    answers = iter([(1, "Error response from daemon: No such container: medserve-manifest-x")])
    map_run._remove_until_gone("docker", "medserve-manifest-x")
    assert len(calls) == 1


def test_a_missing_local_image_is_refused_not_pulled_from_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    """`localhost/NAME` is a local image: when it is missing, the engine would try https://localhost."""
    from medserve.errors import PackagingError

    monkeypatch.setattr(registry, "pull", lambda image, choice: pytest.fail(f"pulled {image}"))
    monkeypatch.setattr(map_run, "_image_present", lambda image, tool: False)
    with pytest.raises(PackagingError, match=r"^localhost/seg:2 is not in podman's local image store; build it "
                                             r"with `medserve package`, or name a registry image$"):
        map_run.ensure_image("localhost/seg:2", "podman")


def test_credentials_go_only_to_their_registry() -> None:
    both = {"MEDSERVE_REGISTRY_USER": "corp", "MEDSERVE_REGISTRY_PASSWORD": "corp-pw",
            "GHCR_USER": "octo", "GHCR_TOKEN": "t0k"}
    ghcr = registry.credentials_from_env("ghcr.io", both)
    assert ghcr is not None and (ghcr.username, ghcr.source) == ("octo", "GHCR_USER/GHCR_TOKEN")
    corp = registry.credentials_from_env("registry.corp:5000", both)
    assert corp is not None and corp.username == "corp"
    scoped = {**both, "MEDSERVE_REGISTRY_HOST": "Registry.Corp:5000"}
    corp = registry.credentials_from_env("registry.corp:5000", scoped)
    assert corp is not None and corp.username == "corp"
    for elsewhere in ("registry.corp", "evil.example:5000", "127.0.0.1:5873"):
        assert registry.credentials_from_env(elsewhere, scoped) is None, elsewhere


def test_a_path_with_a_colon_is_refused_before_the_engine(no_engine_calls: list, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """-v SOURCE:TARGET[:ro] cannot carry a ':' in SOURCE; the engine's own message ('incorrect volume format')
    would not say which path."""
    study = tmp_path / "study:1"
    study.mkdir()
    assert cli_main(["run", "img:1", "-i", str(study), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: -i {study}: the engines' -v SOURCE:TARGET cannot mount a path holding ':'; rename it, " \
                  "or copy it to a path without one\n"
    assert no_engine_calls == [] and not (tmp_path / "out").exists()


def test_a_docker_pull_gets_the_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Docker engine (none runs on these machines: a stand-in `docker` records what it is given), the
    pull receives MEDSERVE_REGISTRY_* through `--config`, and the folder is gone afterwards."""
    record = tmp_path / "record.json"
    shim = tmp_path / "bin" / "docker"
    shim.parent.mkdir()
    shim.write_text(f"""#!{sys.executable}
import json, pathlib, sys
args = sys.argv[1:]
if args[:1] == ["info"]:
    sys.exit(0)
folder = args[args.index("--config") + 1] if "--config" in args else None
config = json.loads((pathlib.Path(folder) / "config.json").read_text()) if folder else None
pathlib.Path({str(record)!r}).write_text(json.dumps({{"args": args, "config": config, "folder": folder}}))
print("sha256:1234")
""")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("MEDSERVE_REGISTRY_USER", "alice")
    monkeypatch.setenv("MEDSERVE_REGISTRY_PASSWORD", "s3cret")
    assert registry.pull("registry.corp:5000/r/seg:1", "docker") == "sha256:1234"
    seen = json.loads(record.read_text())
    assert seen["args"][-2:] == ["pull", "registry.corp:5000/r/seg:1"]
    assert base64.b64decode(seen["config"]["auths"]["registry.corp:5000"]["auth"]) == b"alice:s3cret"
    assert not Path(seen["folder"]).exists()
    assert "s3cret" not in " ".join(seen["args"])


def test_an_interrupted_build_stops_the_builder_so_it_cleans_up(tmp_path: Path) -> None:
    """A SIGTERM to medserve alone left buildah running pip, orphaned, with its working containers: the builder
    is now sent the Ctrl-C a terminal would send it, and waited for while it cleans up."""
    cleaned = tmp_path / "cleaned"
    builder = ("import signal, sys, time\n"
               f"signal.signal(signal.SIGINT, lambda *a: (open({str(cleaned)!r}, 'w').close(), sys.exit(1)))\n"
               "print('STEP 1/9: FROM base', flush=True)\n"
               "time.sleep(60)\n")

    def interrupted(line: str) -> None:
        raise Terminated(signal.SIGTERM)

    started = time.monotonic()
    with pytest.raises(Terminated):
        engine.stream([sys.executable, "-c", builder], "building x:1", interrupted)
    assert cleaned.exists() and time.monotonic() - started < 30


def test_after_a_terminal_ctrl_c_the_builder_is_left_to_clean_up_on_its_own(tmp_path: Path) -> None:
    """The terminal's Ctrl-C reached the builder too: it is waited for, not sent a second SIGINT that could cut
    its clean-up short."""
    signalled = tmp_path / "signalled"
    builder = ("import signal, sys, time\n"
               f"signal.signal(signal.SIGINT, lambda *a: (open({str(signalled)!r}, 'w').close(), sys.exit(1)))\n"
               "print('STEP 1/9: FROM base', flush=True)\n"
               "time.sleep(1)\n")  # ending on its own, as a builder cleaning up after Ctrl-C does

    def interrupted(line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.stream([sys.executable, "-c", builder], "building x:1", interrupted)
    assert not signalled.exists()


@pytest.mark.parametrize(("command", "signum"), [("package", signal.SIGTERM), ("inspect", signal.SIGHUP),
                                                 ("push", signal.SIGTERM)])
def test_sigterm_and_sighup_end_the_container_commands_as_ctrl_c_does(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture, command: str,
        signum: signal.Signals) -> None:
    """They killed `medserve package` and `inspect` outright (exit -15, no message), leaving the build context,
    buildah's containers or the manifests' container: now the clean-up runs, as for Ctrl-C."""
    from medserve.packaging import build

    def signalled(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signum)
        time.sleep(10)
        raise AssertionError("the signal did not interrupt the command")

    monkeypatch.setattr(build, "package", signalled)
    monkeypatch.setattr(map_run, "inspect", signalled)
    monkeypatch.setattr(registry, "push", signalled)
    argv = {"package": ["package", str(tmp_path), "-c", "app.yaml", "-t", "localhost/x:1"],
            "inspect": ["inspect", "localhost/x:1"], "push": ["push", "localhost/x:1", "127.0.0.1:5999/x:1"]}[command]
    assert cli_main(argv) == 128 + signum
    assert capsys.readouterr().err == f"error: interrupted by {signal.Signals(signum).name}\n"
    assert signal.getsignal(signum) is signal.SIG_DFL  # put back afterwards


def test_a_failed_build_is_one_error_line_with_the_builders_last_lines() -> None:
    """It was the last 15 lines joined by escaped newlines: 2.9 KB on one line for a bad pip requirement."""
    builder = ("import sys\n"
               "for n in range(30): print(f'STEP {n}: ' + 'x' * 500)\n"
               "print('ERROR: Invalid requirement: not a req !!'); print('error building at STEP 9: exit status 1')\n"
               "sys.exit(1)\n")
    with pytest.raises(PackagingError) as failed:
        engine.stream([sys.executable, "-c", builder], "building x:1", lambda line: None)
    message = str(failed.value)
    assert message.startswith(f"building x:1 failed ({sys.executable} exit 1): STEP 26: xxx")
    assert message.endswith(" | ERROR: Invalid requirement: not a req !! | error building at STEP 9: exit status 1")
    assert "\n" not in message and len(message) < 1600


def test_a_second_sigterm_does_not_cut_the_first_ones_clean_up_short() -> None:
    """A supervisor that sends SIGTERM twice interrupted the removal of the containers the first one started."""
    cleaned: list[bool] = []
    with pytest.raises(Terminated):
        with termination_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # again, while cleaning up
                time.sleep(0.2)
                cleaned.append(True)
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_links_out_of_the_input_folder_are_refused_before_the_engine(no_engine_calls: list, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """They work with `python app.py` but dangle in the container, where the app skipped them as broken links and
    segmented the rest (or said no DICOM was found)."""
    files = tmp_path / "files"
    files.mkdir()
    for name in ("IM1.dcm", "IM2.dcm"):
        (files / name).write_bytes(b"DICM")
    study = tmp_path / "study"
    (study / "sub").mkdir(parents=True)
    (study / "sub" / "IM0.dcm").write_bytes(b"DICM")
    (study / "same.dcm").symlink_to("sub/IM0.dcm")  # relative, within the folder: fine in the container
    (study / "IM1.dcm").symlink_to(files / "IM1.dcm")  # absolute
    (study / "sub" / "IM2.dcm").symlink_to("../../files/IM2.dcm")  # relative, leaving the folder
    (study / "back.dcm").symlink_to("../study/sub/IM0.dcm")  # leaving and coming back: another parent there
    assert cli_main(["run", "img:1", "-i", str(study), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: input folder {study}: 3 symbolic link(s) name an absolute path or one outside it "
                          f"({study / 'IM1.dcm'} -> {files / 'IM1.dcm'}; {study / 'back.dcm'} -> "
                          f"../study/sub/IM0.dcm; {study / 'sub' / 'IM2.dcm'} -> ../../files/IM2.dcm); the container "
                          "sees only this folder"), err
    assert no_engine_calls == [] and not (tmp_path / "out").exists()
    for link in ("IM1.dcm", "back.dcm", "sub/IM2.dcm"):
        (study / link).unlink()
    map_run._check_links_stay_inside(study)  # a relative link within the folder is left alone


def test_a_run_without_an_output_folder_says_its_results_are_not_kept(no_engine_calls: list, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """It printed "wrote /var/holoscan/output/seg.dcm" and exited 0, the files gone with the container."""
    study = tmp_path / "study"
    study.mkdir()
    map_run.prepare(RunRequest("img:1", input=study, output=None))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "no -o: what the app writes stays in its container, which is removed when the app ends"]
    caplog.clear()
    map_run.prepare(RunRequest("img:1", input=study, output=tmp_path / "out"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
