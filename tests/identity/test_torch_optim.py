"""torch.optim optimizers (and their LR schedulers) over a Keras model's variables, on the
Torch backend: saved by each variable's key, restored onto the right variable whatever order
the parameters come in, checked like a Keras optimizer's slots; a stepped optimizer that a
save leaves out is named. Every resume is compared by position with an uninterrupted run
computed here (weights, each optimizer state tensor, the scheduler's learning rate)."""

import keras
import numpy as np
import pytest
from kit import mlp

import keras_stable_state as kss

BACKEND = keras.backend.backend()
torch_only = pytest.mark.skipif(
    BACKEND != "torch", reason="a torch.optim optimizer trains Keras variables on the torch backend only"
)
STEPS, SAVE_AT = 8, 3


def _data(seed=0, features=4):
    import torch

    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=(STEPS, 8, features)), dtype=torch.float32)
    y = torch.tensor(rng.normal(size=(STEPS, 8, 1)), dtype=torch.float32)
    return x, y


def _adam(model):
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _sgd(model):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, nesterov=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _adamw_groups(model):
    """AdamW with two param groups: weight decay on the kernels only."""
    import torch

    kernels = [v.value for v in model.trainable_variables if v.path.endswith("kernel")]
    biases = [v.value for v in model.trainable_variables if v.path.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": kernels, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}], lr=1e-2
    )
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3)


MAKERS = {"adam-steplr": _adam, "sgd-momentum-lambdalr": _sgd, "adamw-groups-steplr": _adamw_groups}


def _run(model, opt, sched, data, steps):
    x, y = data
    for i in steps:
        opt.zero_grad()
        loss = ((model(x[i]) - y[i]) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()


def _fresh(make, seed):
    model = mlp(features=4, hidden=4, named=True, optimizer=None, seed=seed)
    opt, sched = make(model)
    return model, opt, sched


def _assert_same(model_a, opt_a, sched_a, model_b, opt_b, sched_b):
    """Weights, every optimizer state tensor and group hyperparameter, the scheduler's
    state: equal by position, bit for bit."""
    import torch

    for va, vb in zip(model_a.weights, model_b.weights, strict=True):
        np.testing.assert_array_equal(va.numpy(), vb.numpy(), err_msg=va.path)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for pos, entries in sa["state"].items():
        assert sorted(entries) == sorted(sb["state"][pos])
        for name, value in entries.items():
            other = sb["state"][pos][name]
            assert value.dtype == other.dtype, (pos, name)
            assert torch.equal(value, other), (pos, name)
    assert sched_a.get_last_lr() == sched_b.get_last_lr()
    la = {k: v for k, v in sched_a.state_dict().items() if k != "lr_lambdas"}
    lb = {k: v for k, v in sched_b.state_dict().items() if k != "lr_lambdas"}
    assert la == lb


@torch_only
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_resume_equals_the_uninterrupted_run(tmp_path, kind):
    make, data = MAKERS[kind], _data()
    ref = _fresh(make, seed=1)
    _run(*ref, data, range(STEPS))

    first = _fresh(make, seed=1)
    _run(*first, data, range(SAVE_AT))
    path = str(tmp_path / "run.h5")
    kss.save_training_state(path, first[0], optimizer=first[1], state={"scheduler": first[2]})

    model, opt, sched = _fresh(make, seed=7)  # other initial weights: all of them come from the file
    report = kss.restore_training_state(path, model, optimizer=opt, state={"scheduler": sched})
    assert "state:scheduler" in report.restored_state
    assert report.by_order == [] and report.left_fresh == [] and report.dropped == []
    assert "path:layers/hidden/kernel#exp_avg" in report.matched or kind.startswith("sgd")
    _run(model, opt, sched, data, range(SAVE_AT, STEPS))
    _assert_same(*ref, model, opt, sched)


class _Pair(keras.Model):
    """Two same-shape Dense layers applied ``first`` then ``second``; ``reverse`` creates the
    attributes in the other order, so model.parameters() comes in another order."""

    def __init__(self, reverse=False, **kwargs):
        super().__init__(**kwargs)
        if reverse:
            self.second = keras.layers.Dense(4)
            self.first = keras.layers.Dense(4)
        else:
            self.first = keras.layers.Dense(4)
            self.second = keras.layers.Dense(4)

    def call(self, x):
        return self.second(self.first(x))


def _pair(reverse, seed):
    keras.utils.set_random_seed(seed)
    model = _Pair(reverse=reverse)
    model(np.zeros((1, 4), "float32"))
    return model


@torch_only
def test_parameters_in_another_order_and_groups_split_otherwise_restore_onto_their_variables(tmp_path):
    import torch

    x, y = _data(features=4)
    y = y.repeat(1, 1, 4)

    def loop(model, opt, steps):
        for i in steps:
            opt.zero_grad()
            ((model(x[i]) - y[i]) ** 2).mean().backward()
            opt.step()

    ref = _pair(False, seed=1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    loop(ref, ref_opt, range(STEPS))

    saved = _pair(False, seed=1)
    saved_opt = torch.optim.Adam(saved.parameters(), lr=1e-2)
    loop(saved, saved_opt, range(SAVE_AT))
    path = str(tmp_path / "pair.h5")
    kss.save_training_state(path, saved, optimizer=saved_opt)

    model = _pair(True, seed=3)

    def named(m):
        return {
            (layer, w): getattr(getattr(m, layer), w)
            for layer in ("first", "second")
            for w in ("kernel", "bias")
        }

    live, was = named(model), named(saved)
    order = [next(k for k, v in live.items() if v.value is p) for p in model.parameters()]
    assert order != [next(k for k, v in was.items() if v.value is p) for p in saved.parameters()], (
        "the parameters must come in another order for this test to mean anything"
    )
    kernels = [v.value for k, v in live.items() if k[1] == "kernel"]
    biases = [v.value for k, v in live.items() if k[1] == "bias"]
    opt = torch.optim.Adam([{"params": biases}, {"params": kernels}], lr=1e-2)  # split otherwise
    kss.restore_training_state(path, model, optimizer=opt)
    loop(model, opt, range(SAVE_AT, STEPS))
    for key, ref_var in named(ref).items():
        np.testing.assert_array_equal(live[key].numpy(), ref_var.numpy(), err_msg=str(key))
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[live[key].value][name], ref_opt.state[ref_var.value][name]), (
                key,
                name,
            )


@torch_only
def test_groups_saved_with_other_hyperparameters_cannot_be_merged(tmp_path):
    import torch

    model, opt, sched = _fresh(_adamw_groups, seed=1)
    _run(model, opt, sched, _data(), range(2))
    path = str(tmp_path / "groups.h5")
    kss.save_training_state(path, model, optimizer=opt)
    fresh = mlp(features=4, hidden=4, named=True, optimizer=None, seed=2)
    merged = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with pytest.raises(kss.BindingError, match=r"Param group 0 .*weight_decay"):
        kss.restore_training_state(path, fresh, optimizer=merged)


@torch_only
def test_mismatches_are_refused_naming_the_keys_and_strict_false_reports_them(tmp_path):
    import torch

    model, opt, sched = _fresh(_adam, seed=1)
    _run(model, opt, sched, _data(), range(2))
    path = str(tmp_path / "run.h5")
    kss.save_training_state(path, model, optimizer=opt)

    other = mlp(features=4, hidden=5, named=True, optimizer=None, seed=2)
    with pytest.raises(kss.ContractError, match="path:layers/hidden/kernel"):
        kss.restore_training_state(path, other, optimizer=torch.optim.Adam(other.parameters()))

    fresh = mlp(features=4, hidden=4, named=True, optimizer=None, seed=2)
    hidden_only = torch.optim.Adam(fresh.get_layer("hidden").parameters(), lr=1e-2)
    with pytest.raises(kss.BindingError, match=r"does not train: \['path:layers/out/bias'"):
        kss.restore_training_state(path, fresh, optimizer=hidden_only)
    report = kss.restore_training_state(path, fresh, optimizer=hidden_only, strict=False)
    assert report.dropped_reasons["path:layers/out/kernel#exp_avg"] == (
        "not trained by the live torch.optim optimizer"
    )
    assert torch.equal(
        hidden_only.state[fresh.get_layer("hidden").kernel.value]["exp_avg"],
        opt.state[model.get_layer("hidden").kernel.value]["exp_avg"],
    )

    # saved over the hidden layer alone, restored into an optimizer over every variable
    path2 = str(tmp_path / "hidden.h5")
    kss.save_training_state(path2, fresh, optimizer=hidden_only)
    everything = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with pytest.raises(kss.BindingError, match=r"no saved state for variables the live optimizer trains"):
        kss.restore_training_state(path2, fresh, optimizer=everything)
    report = kss.restore_training_state(path2, fresh, optimizer=everything, strict=False)
    assert sorted(report.left_fresh) == ["path:layers/out/bias#*", "path:layers/out/kernel#*"]

    with pytest.raises(kss.BindingError, match="torch.optim.sgd.SGD"):
        kss.restore_training_state(path, fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(kss.BindingError, match=r"torch.optim optimizer\(s\) \['optimizer'\] \(\['Adam'\]\)"):
        kss.restore_training_state(path, fresh)  # saved with one, restored without
    report = kss.restore_training_state(path, fresh, strict=False)
    assert report.dropped_reasons["optimizer:optimizer"].startswith("no live torch.optim optimizer")


@torch_only
def test_a_stepped_optimizer_left_out_of_the_save_is_named(tmp_path):
    import torch

    model, opt, sched = _fresh(_adam, seed=1)
    _run(model, opt, sched, _data(), range(2))
    with pytest.raises(kss.StateError, match=r"\['Adam'\] stepped .* optimizer=opt"):
        kss.save_training_state(str(tmp_path / "a.h5"), model)
    manager = kss.CheckpointManager(str(tmp_path / "ckpts"))
    with pytest.raises(kss.StateError, match=r"\['Adam'\] stepped"):
        manager.save(2, model)
    with pytest.raises(TypeError, match="Pass it as `optimizer=`"):
        kss.save_training_state(str(tmp_path / "a.h5"), model, state={"opt": opt})
    del opt, sched

    # plain SGD without momentum and no scheduler holds nothing a fresh one lacks: no word
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    ((model(x[0]) - y[0]) ** 2).mean().backward()
    sgd.step()
    kss.save_training_state(str(tmp_path / "b.h5"), model)


@torch_only
def test_checkpoint_manager_and_bytes_round_trip(tmp_path):
    make, data = _adam, _data()
    ref = _fresh(make, seed=1)
    _run(*ref, data, range(STEPS))

    model, opt, sched = _fresh(make, seed=1)
    manager = kss.CheckpointManager(str(tmp_path / "ckpts"))
    for step in range(SAVE_AT):
        _run(model, opt, sched, data, [step])
        manager.save(step + 1, model, optimizer=opt, state={"scheduler": sched})
    blob = kss.training_state_to_bytes(model, opt, state={"scheduler": sched})
    manager.close()

    resumed = _fresh(make, seed=9)
    with kss.CheckpointManager(str(tmp_path / "ckpts")) as again:
        again.restore(resumed[0], optimizer=resumed[1], state={"scheduler": resumed[2]})
        assert again.restored_step == SAVE_AT
    _run(*resumed, data, range(SAVE_AT, STEPS))
    _assert_same(*ref, *resumed)

    from_bytes = _fresh(make, seed=9)
    kss.restore_training_state_from_bytes(
        blob, from_bytes[0], from_bytes[1], state={"scheduler": from_bytes[2]}
    )
    _run(*from_bytes, data, range(SAVE_AT, STEPS))
    _assert_same(*ref, *from_bytes)


@torch_only
def test_a_parameter_outside_the_model_is_refused_and_a_variable_outside_it_is_saved_by_name(tmp_path):
    import torch

    model = mlp(features=4, hidden=4, named=True, optimizer=None, seed=1)
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([*model.parameters(), stray])
    with pytest.raises(kss.BindingError, match=r"param_groups\[0\]\['params'\]\[4\] .*variables="):
        kss.save_training_state(str(tmp_path / "a.h5"), model, optimizer=opt)

    log_alpha = keras.Variable(0.0, name="log_alpha")
    opt = torch.optim.Adam([*model.parameters(), log_alpha.value], lr=1e-2)
    x, y = _data()
    (((model(x[0]) - y[0]) ** 2).mean() + log_alpha.value**2).backward()
    opt.step()
    path = str(tmp_path / "b.h5")
    kss.save_training_state(path, model, optimizer=opt, variables={"log_alpha": log_alpha})
    fresh_alpha = keras.Variable(1.0, name="log_alpha")
    fresh = mlp(features=4, hidden=4, named=True, optimizer=None, seed=2)
    fresh_opt = torch.optim.Adam([fresh_alpha.value, *fresh.parameters()], lr=1e-2)
    report = kss.restore_training_state(
        path, fresh, optimizer=fresh_opt, variables={"log_alpha": fresh_alpha}
    )
    assert report.matched["var:log_alpha#exp_avg"] == "name"
    assert torch.equal(fresh_opt.state[fresh_alpha.value]["exp_avg"], opt.state[log_alpha.value]["exp_avg"])


@pytest.mark.frameworks("torch")
@pytest.mark.skipif(BACKEND == "torch", reason="the refusal of a torch.optim optimizer on another backend")
def test_a_torch_optimizer_on_another_backend_is_refused(tmp_path):
    import torch

    model = mlp(features=4, hidden=4, optimizer=None, seed=1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="KERAS_BACKEND=torch"):
        kss.save_training_state(str(tmp_path / "a.h5"), model, optimizer=opt)


@torch_only
def test_two_named_optimizers_restore_all_or_nothing(tmp_path):
    """``optimizer={"a": ..., "b": ...}`` keys each one's state ``#@a/...``; when the second
    refuses its state the first is put back as it was."""
    import torch

    def pair(seed):
        model = mlp(features=4, hidden=4, named=True, optimizer=None, seed=seed)
        a = torch.optim.Adam(model.get_layer("hidden").parameters(), lr=1e-2)
        b = torch.optim.SGD(model.get_layer("out").parameters(), lr=1e-2, momentum=0.9)
        x, y = _data()
        for i in range(2):
            a.zero_grad()
            b.zero_grad()
            ((model(x[i]) - y[i]) ** 2).mean().backward()
            a.step()
            b.step()
        return model, a, b

    model, a, b = pair(1)
    path = str(tmp_path / "two.h5")
    kss.save_training_state(path, model, optimizer={"a": a, "b": b})

    fresh, a2, b2 = pair(2)
    before = {k: v.clone() for k, v in a2.state[fresh.get_layer("hidden").kernel.value].items()}

    def refuse(state_dict):
        raise RuntimeError("refused")

    b2.load_state_dict = refuse
    with pytest.raises(RuntimeError, match="refused"):
        kss.restore_training_state(path, fresh, optimizer={"a": a2, "b": b2})
    after = a2.state[fresh.get_layer("hidden").kernel.value]
    assert all(torch.equal(before[k], after[k]) for k in before)

    del b2.load_state_dict
    report = kss.restore_training_state(path, fresh, optimizer={"a": a2, "b": b2})
    assert report.matched["path:layers/hidden/kernel#@a/exp_avg"] == "name"
    assert report.matched["path:layers/out/kernel#@b/momentum_buffer"] == "name"
    assert torch.equal(
        b2.state[fresh.get_layer("out").kernel.value]["momentum_buffer"],
        b.state[model.get_layer("out").kernel.value]["momentum_buffer"],
    )


@torch_only
def test_learning_rates_replaced_are_reported_and_keep_learning_rate_keeps_them(tmp_path):
    model, opt, sched = _fresh(_adam, seed=1)
    _run(model, opt, sched, _data(), range(SAVE_AT))  # StepLR(2, 0.5): lr 0.01 -> 0.005
    path = str(tmp_path / "run.h5")
    kss.save_training_state(path, model, optimizer=opt)
    fresh, fresh_opt, _ = _fresh(_adam, seed=2)
    report = kss.restore_training_state(path, fresh, optimizer=fresh_opt)
    assert report.learning_rates == [("optimizer:optimizer/param_groups/0/lr", 0.01, 0.005, "replaced")]
    assert fresh_opt.param_groups[0]["lr"] == 0.005
    fresh, fresh_opt, _ = _fresh(_adam, seed=2)
    report = kss.restore_training_state(path, fresh, optimizer=fresh_opt, keep_learning_rate=True)
    assert report.learning_rates == [("optimizer:optimizer/param_groups/0/lr", 0.01, 0.005, "kept")]
    assert fresh_opt.param_groups[0]["lr"] == 0.01
