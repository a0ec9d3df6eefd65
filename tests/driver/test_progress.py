"""The driver's progress (driver/stage.py, reports.epoch_lines): an epoch is printed once every rank has
finished it in the applied log, with its mean loss over all ranks' steps and rank 0's score once it came
(or when the next epoch finished, or at the end); never twice; a resumed fit counts from its first epoch."""

from gradshare.driver.stage import ProgressBar
from gradshare.reports import EpochLine, epoch_lines


def tally(steps, loss, val=None):
    return {"steps": steps, "loss": loss, "val_metric": val}


def test_an_epoch_counts_once_every_rank_finished_it_and_its_loss_is_the_mean_over_all_steps():
    tallies = {(0, 0): tally(3, 3.0, 0.5), (1, 0): tally(2, 4.0), (0, 1): tally(3, 1.5), (1, 1): tally(1, 1.0)}
    assert epoch_lines(tallies, (3, 2)) == [EpochLine(0, 7.0 / 5, 0.5)]  # rank 1 has 1 of its 2 steps of epoch 1
    tallies[(1, 1)] = tally(2, 2.0)
    assert epoch_lines(tallies, (3, 2)) == [EpochLine(0, 1.4, 0.5), EpochLine(1, 3.5 / 5, None)]
    many = {(0, e): tally(1, float(e)) for e in range(20)}
    assert [line.epoch for line in epoch_lines(many, (1,), last=3)] == [17, 18, 19]


def test_the_bar_prints_each_epoch_once_waiting_for_its_score(capsys):
    shown = []
    bar = ProgressBar(10, enabled=True, first_epoch=5, scored=True, lines=lambda: shown)
    bar.read_at = -1e9
    shown[:] = [EpochLine(0, 2.0, None)]
    bar.update({"complete_through": 3})  # epoch 0 finished, its score not yet in the log: wait
    bar.read_at = -1e9
    shown[:] = [EpochLine(0, 2.0, 0.25)]
    bar.update({"complete_through": 4})
    bar.read_at = -1e9
    bar.update({"complete_through": 5})  # nothing new: nothing printed again
    shown[:] = [EpochLine(0, 2.0, 0.25), EpochLine(1, 1.5, None)]
    bar.close()  # the end: the last epoch as it is
    err = capsys.readouterr().out  # tqdm.write: stdout, above the bar
    assert err.count("epoch 5: loss 2.0000, val_metric 0.2500") == 1 and "epoch 6: loss 1.5000\n" in err
    assert err.index("epoch 5") < err.index("epoch 6")


def test_without_validation_an_epoch_is_printed_as_soon_as_it_finished(capsys):
    bar = ProgressBar(10, enabled=True, lines=lambda: [EpochLine(0, 1.0, None)])
    bar.read_at = -1e9
    bar.update({"complete_through": 2})
    assert "epoch 0: loss 1.0000\n" in capsys.readouterr().out
    bar.close()
    assert "epoch 0" not in capsys.readouterr().out
