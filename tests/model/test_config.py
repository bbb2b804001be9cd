"""HSTUConfig refuses what a backend cannot run, naming the rule."""
from __future__ import annotations

import pytest

from model.config import PRESET_NAMES, HSTUConfig, preset


@pytest.mark.parametrize("head_dim", [0, 8, 24, 96, 100])
def test_a_head_dim_the_kernel_cannot_compile_is_refused(head_dim):
    with pytest.raises(ValueError, match=f"head_dim must be a power of two >= 16 .*got {head_dim}"):
        HSTUConfig(head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_power_of_two_head_dims_are_accepted(head_dim):
    assert HSTUConfig(head_dim=head_dim).attention_dim == 4 * head_dim


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_is_valid_and_round_trips(name):
    config = preset(name)
    assert HSTUConfig.from_dict(config.to_dict()) == config


def test_a_negative_attention_window_is_refused():
    with pytest.raises(ValueError, match="attention_window must be >= 0"):
        HSTUConfig(attention_window=-1)


def test_a_checkpoint_from_before_the_window_attends_to_its_whole_window():
    old = {k: v for k, v in preset("tiny").to_dict().items() if k != "attention_window"}
    assert HSTUConfig.from_dict(old).attention_window == 0


@pytest.mark.parametrize("crop, asked, served", [(128, None, 128), (None, None, 0), (128, 0, 0), (128, 64, 64)])
def test_a_fresh_model_is_served_the_window_it_was_trained_on(crop, asked, served):
    from model.train_params import TrainParams, trained_attention_window

    assert trained_attention_window(TrainParams(max_history_events=crop, attention_window=asked)) == served


def test_the_trainer_refuses_a_negative_attention_window_before_reading_anything(tmp_path, capsys):
    from model.train import main

    checkpoint = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main(["--data_dir", str(tmp_path / "absent"), "--checkpoint", str(checkpoint), "--attention_window", "-3"])
    assert exit_info.value.code == 2
    assert "--attention_window: must be >= 0 (0 = the whole window), got -3" in capsys.readouterr().err
    assert not checkpoint.exists()


def test_the_trainer_refuses_a_delay_that_leaves_no_epoch_to_train(tmp_path, capsys):
    from model.train import main

    checkpoint = tmp_path / "ckpt"
    argv = ["--data_dir", str(tmp_path / "absent"), "--checkpoint", str(checkpoint), "--epochs", "2",
            "--candidate_terms_delay_epochs", "2"]
    assert main(argv) == 2
    assert "error: candidate_terms_delay_epochs must be in [0, epochs = 2), got 2" in capsys.readouterr().err
    assert not checkpoint.exists()


@pytest.mark.parametrize("option", [("--candidate_terms_delay_epochs", "5"), ("--next_item_loss_weight", "-1")])
def test_the_quality_benchmark_refuses_a_bad_recipe_with_an_error_line(tmp_path, capsys, option):
    from benchmark.quality.against_baselines import main

    checkpoint, output = tmp_path / "ckpt", tmp_path / "q.json"
    argv = ["--data_dir", str(tmp_path / "absent"), "--checkpoint", str(checkpoint), "--retrain", "--epochs", "3",
            *option, "--output", str(output)]
    assert main(argv) == 2
    assert f"error: {option[0][2:]} must be" in capsys.readouterr().err
    assert not checkpoint.exists() and not output.exists()


def test_recipe_options_reach_the_train_params():
    import argparse

    from model.train_arguments import add_recipe_arguments, recipe_params
    from model.train_params import TrainParams

    p = argparse.ArgumentParser()
    add_recipe_arguments(p)
    params = recipe_params(p.parse_args(["--attention_window", "64", "--learning_rate", "3e-4", "--video_tags",
                                         "--tag_embedding_std", "0.7", "--no-tied_query_key_init",
                                         "--id_embedding_std", "none", "--id_dropout", "0.3"]), seed=5)
    assert (params.attention_window, params.learning_rate, params.video_tags, params.seed) == (64, 3e-4, True, 5)
    assert (params.tag_embedding_std, params.tied_query_key_init, params.id_embedding_std) == (0.7, False, None)
    assert params.id_dropout == 0.3
    assert recipe_params(p.parse_args([])) == TrainParams()


def test_a_named_recipe_sets_the_defaults_and_explicit_options_win():
    import argparse
    import dataclasses

    from model.train_arguments import add_recipe_arguments, parse_recipe_arguments, recipe_params
    from model.train_params import RECIPES, TrainParams

    fields = {f.name for f in dataclasses.fields(TrainParams)}
    assert all(set(recipe) <= fields for recipe in RECIPES.values())

    def params(*argv):
        p = argparse.ArgumentParser()
        add_recipe_arguments(p)
        return recipe_params(parse_recipe_arguments(p, list(argv)))

    no_ids = params("--recipe", "no-ids")
    assert {name: getattr(no_ids, name) for name in RECIPES["no-ids"]} == RECIPES["no-ids"]
    overridden = params("--recipe", "no-ids", "--video_hash_size", "7")
    assert overridden.video_hash_size == 7 and overridden.id_dropout == RECIPES["no-ids"]["id_dropout"]
    assert params() == TrainParams() == params("--recipe", "default")
    # The default's switches turn off from the command line.
    without = params("--no-tag_match_bias", "--no-tied_query_key_init", "--no-video_tags")
    assert not without.tag_match_bias and not without.tied_query_key_init and without.video_tags is False


def test_the_benchmarks_refuse_bad_interval_and_baseline_options(tmp_path, capsys):
    from benchmark.quality.against_baselines import main as quality_main
    from benchmark.quality.tag_probe import main as probe_main

    output = tmp_path / "q.json"
    with pytest.raises(SystemExit):
        quality_main(["--data_dir", str(tmp_path), "--resamples", "0", "--output", str(output)])
    assert "--resamples must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe_main(["--data_dir", str(tmp_path), "--baselines", "random forest", "--output", str(output)])
    assert "--baselines: unknown baseline 'random forest'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe_main(["--data_dir", str(tmp_path), "--stack_windows", "0", "--output", str(output)])
    assert "--stack_windows and --resamples must be >= 1" in capsys.readouterr().err
    assert not output.exists()
