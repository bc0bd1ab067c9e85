"""Where the bytes go: the engines a training state is written and read through.

* `files`: one ``.h5`` / ``.keras`` file written in the calling thread, atomically on a
  local disk, or uploaded whole to an object store.
* `object_store`: objects in a store (``s3://``, ``gs://``...) through fsspec (`RemotePath`,
  commit markers, `object_store.target` and `object_store.fetch`), its failures in our words
  (`store_failures`). It imports no Keras: the command line reads object stores through it.
* `orbax`: a ``.orbax`` folder, its arrays an Orbax checkpoint (every JAX process its own
  shards), and the array source a restore reads them through (`orbax.open_source`).
* `background`: a file written in another thread (``blocking=False``).

`dispatch` picks the one engine a save writes through (`dispatch.save_engine`) and reads a
training state for a restore through one door (`dispatch.read`), so that the restore core
and ``save_training_state`` never import the Orbax engine. A `write_request.WriteRequest` is what a
save hands to its engine.

This package's ``__init__`` imports nothing: importing ``keras_stable_state._engines.object_store``
(the command line does) loads no Keras and no framework.
"""
