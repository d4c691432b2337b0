"""The shipped `configs/accelerate/*.yaml` read the way `accelerate launch --config_file` reads them, offline: a
key Accelerate does not know, or a value it refuses, fails here instead of on the cluster."""

import argparse
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "accelerate").glob("*.yaml"))


def launch_env(config_file) -> tuple[argparse.Namespace, dict[str, str]]:
    """The torchrun arguments and the environment `accelerate launch --config_file CONFIG_FILE train.py` gives the
    training processes. Keys
    are checked first: Accelerate rejects an unknown top-level key but copies an unknown `fsdp_config` key onto
    its arguments without a word."""
    config = ClusterConfig.from_yaml_file(str(config_file))  # ValueError on an unknown top-level key
    parser = launch_command_parser()
    options = {action.dest for action in parser._actions}
    unknown = sorted(key for key in config.fsdp_config if key not in options)
    if unknown:
        raise ValueError(f"{config_file}: fsdp_config has key(s) accelerate launch does not know: {unknown}")
    args = parser.parse_args(["--config_file", str(config_file), "train.py"])
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return args, env


def fsdp_plugin_from(env: dict[str, str]) -> FullyShardedDataParallelPlugin:
    """The FSDP plugin `Accelerator()` builds in a process launched with `env`."""
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}):
        return FullyShardedDataParallelPlugin()


def test_there_are_ddp_and_fsdp_configs_for_one_and_several_machines():
    names = {path.stem for path in CONFIGS}
    assert {"ddp", "ddp-multinode", "fsdp", "fsdp-multinode"} <= names
    for path in CONFIGS:
        config = ClusterConfig.from_yaml_file(str(path))
        assert config.distributed_type == (DistributedType.FSDP if path.stem.startswith("fsdp") else
                                           DistributedType.MULTI_GPU)
        assert (config.num_machines > 1) == path.stem.endswith("multinode")
        assert config.num_processes % config.num_machines == 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_launches_as_written(path):
    args, env = launch_env(path)
    config = yaml.safe_load(path.read_text())
    assert env["ACCELERATE_MIXED_PRECISION"] == config["mixed_precision"]
    # torchrun's processes per machine and, over several machines, its rendezvous, from the config
    assert int(args.nproc_per_node) * config["num_machines"] == config["num_processes"]
    if config["num_machines"] > 1:
        endpoint = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
        assert (args.nnodes, endpoint) == (str(config["num_machines"]),
                                           f"{config['main_process_ip']}:{config['main_process_port']}")
    if config["distributed_type"] == "FSDP":
        assert env["ACCELERATE_USE_FSDP"] == "true"
        plugin = fsdp_plugin_from(env)
        assert plugin.fsdp_version == config["fsdp_config"]["fsdp_version"] == 2
        assert plugin.reshard_after_forward is True and "CPUOffload" not in type(plugin.cpu_offload).__name__
        assert plugin.state_dict_type.name == "FULL_STATE_DICT"
    else:
        assert "ACCELERATE_USE_FSDP" not in env


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(num_machine=2), r"unknown keys \(\['num_machine'\]\)"),
    (lambda c: c["fsdp_config"].update(fsdp_reshard_after_forwad=True), "fsdp_reshard_after_forwad"),
    (lambda c: c["fsdp_config"].update(fsdp_auto_wrap_policy="TRANSFORMER_WRAP"), "auto wrap policy"),
    (lambda c: c.update(distributed_type="MULTI_GPUS"), "MULTI_GPUS"),
])
def test_a_typo_in_a_config_fails(tmp_path, edit, match):
    config = yaml.safe_load((CONFIGS[0].parent / "fsdp.yaml").read_text())
    edit(config)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=match):
        fsdp_plugin_from(launch_env(path)[1])
