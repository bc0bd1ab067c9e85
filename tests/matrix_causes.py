"""The named causes of the resume matrix's warned and refused results (tests/matrix.py).

A cause is the ``"Category: message"`` text of an ``InexactResumeWarning`` (or of a
refusal) at train begin of a resume. :func:`classify_cause` gives it a name that says
what was not resumed (with the callback, layers or fields the message names) and the
*acceptance class*: ``"callback"`` (a user's callback without ``get_state()``), ``"cross_backend"``
(random layers resumed on another backend), ``"input"`` (an input the docs name as not
replayable), ``"data"`` (the resume was drawn with other data on purpose), ``"decoy"`` (a
decoy model renamed the layers a ``MultiOptimizer``'s patterns route by: refused) or ``None``
(a cause the library is expected to remove). A message no pattern knows is named by its
first sentence, whole, and is not accepted.
"""

from __future__ import annotations

import re

#: The acceptance classes of causes a WARNED result may have (issue 33's acceptance: user
#: callbacks without state, cross-backend random layers, inputs the docs name), and the
#: resumes drawn with other data on purpose (``batch_changed``).
ACCEPTED = {
    "callback": "a user callback without get_state()/set_state()",
    "cross_backend": "random layers resumed on another backend",
    "input": "an input the docs name as not replayable",
    "data": "other data drawn for the resume on purpose (batch_changed)",
    "decoy": "a decoy model built first renamed the layers a MultiOptimizer's patterns route by (refused: the run's routing changed)",
}


def _fields(text):
    return ", ".join(re.findall(r"(\w+) saved", text))


# (regex on the message, name (format of the groups), acceptance class)
_PATTERNS = (
    (
        r"the callback (\w+) of this fit has no get_state\(\)/set_state\(\)",
        "user callback without get_state()/set_state(): {0}",
        "callback",
    ),
    (
        r"the callback (\w+) of this fit keeps state \((.*?)\) that is not saved",
        "Keras stateful callback not given in StableCheckpoint(callbacks=...): {0} ({1})",
        None,
    ),
    (
        r"written on (\w+) and training resumes on (\w+); the layers",
        "random layers resumed on another backend ({0} -> {1})",
        "cross_backend",
    ),
    (
        r"written on (\w+) and training resumes on (\w+), and this fit's input has no known length",
        "input of unknown length resumed across TensorFlow ({0} -> {1}: TensorFlow counts one more step per epoch)",
        "input",
    ),
    (
        r"written on (\w+) and training resumes on (\w+); this model reports a loss per output",
        "per-output losses averaged over batches on TensorFlow, over samples elsewhere, with unequal batches ({0} -> {1})",
        "input",
    ),
    (
        r"written on (\w+) and training resumes on (\w+) with a torch DataLoader input whose order draws",
        "torch DataLoader resumed across the Torch backend ({0} -> {1}: Keras' Torch fit makes two iterators per epoch)",
        "input",
    ),
    (
        r"shuffled NumPy input was ordered by (\w+)'s fit .* training resumes on (\w+)",
        "shuffled NumPy order of {0}'s fit continued on {1} (later epochs drawn by {1})",
        "input",
    ),
    (
        r"overrides on_epoch_end\(\) but has no get_state\(\)/set_state\(\)",
        "PyDataset overriding on_epoch_end() without get_state()/set_state()",
        "input",
    ),
    (
        r"fit shuffles array inputs (with steps_per_epoch|whose arrays are not NumPy arrays)",
        "fit's own shuffle of arrays {0}",
        "input",
    ),
    (
        r"reshuffle_each_iteration=True\)",
        "tf.data shuffle(reshuffle_each_iteration=True)",
        None,
    ),
    (
        r"random seeds \(seed, seed2\) of the input tf.data pipeline",
        "tf.data pipeline made under another global seed than the checkpoint's run",
        "input",
    ),
    (
        r"py_function|cannot checkpoint|not checkpointable",
        "tf.data pipeline tf.data cannot checkpoint (e.g. py_function)",
        "input",
    ),
    (
        r"(?i)sampler.*(no|without) (a )?state_dict",
        "torch sampler with hidden state and no state_dict()",
        "input",
    ),
    (
        r"did not save the epoch's sample order",
        "checkpoint of an older version without the epoch's sample order",
        None,
    ),
    (
        r"counted (samples|batches) in the interrupted epoch; this fit on \w+ counts (samples|batches)",
        "per-output loss means counted in {0} when saved, {1} now",
        None,
    ),
    (
        r"the callback (\w+) of this fit overrides on_epoch_begin",
        "on_epoch_begin of {0} run again in the resumed epoch",
        None,
    ),
    (
        r"the callback (\w+) is listed before StableCheckpoint",
        "{0} listed before StableCheckpoint overrides on_epoch_begin",
        None,
    ),
    (
        r"the data of this fit differ from those the checkpoint \(end of epoch \d+\) was saved with \(([^)]*)\)",
        "other data at an epoch-boundary resume ({0})",
        "data",
    ),
    (
        r"data of this fit differ from those the checkpoint was saved with \(([^)]*)\); on_data_change",
        "other data, epoch restarted ({0})",
        "data",
    ),
    (
        r"with other data than this fit's \(([^)]*)\)",
        "mid-epoch checkpoint with other data ({0})",
        "data",
    ),
    (
        r"iteration counter, whose maximum",
        "optimizer iteration counter would wrap",
        None,
    ),
    (
        r"parameter groups of (\S+) differ",
        "parameter groups of {0} differ from the saved ones",
        "decoy",
    ),
    (
        r"(?i)replica",
        "another number of replicas",
        None,
    ),
)


def first_sentence(message):
    """``message`` up to the end of its first sentence (a period before a capital or the
    end), object reprs and quoted paths shortened; never cut at a colon."""
    text = re.sub(r"<[^<>]*(<[^<>]*>[^<>]*)*>", "<...>", message)
    text = re.sub(r"'[^']*/[^']*'", "'...'", text)
    text = re.sub(r"^StableCheckpoint:\s*", "", text.strip())
    m = re.search(r"\.\s+(?=[A-Z`])", text)
    return text[: m.start() + 1] if m else text


def classify_cause(cause):
    """``(name, acceptance class or None)`` of ``cause`` (``"Category: message"``)."""
    category, _, message = cause.partition(": ")
    flat = " ".join(message.split())
    for pattern, name, accepted in _PATTERNS:
        m = re.search(pattern, flat)
        if m:
            groups = [_fields(g) if "saved" in (g or "") else g for g in m.groups()]
            return f"{category}: {name.format(*groups)}", accepted
    return f"{category} (unclassified): {first_sentence(flat)}", None
