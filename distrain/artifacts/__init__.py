"""Inspectors of the files users hand distrain, one per kind of artifact, run before any rank starts.

Each returns what the artifact is, or raises ``distrain.errors.ArtifactError`` with one line naming the file and
what is wrong with it; every entry point that reads that kind (``train.py``'s validation, ``check_model``,
``export``, ``generate``, ``prepare``) asks the same inspector. docs/inputs.md lists what each one checks.

- ``hf_directory``: a Hugging Face model directory (config.json and its weights)
- ``safetensors_set``: safetensors weight files (one, or an index's shards)
- ``token_dataset``: a prepared (or nanoGPT) token dataset
- ``tokenizer``: a ``tokenizer.json`` or a directory holding one (or nanoGPT's ``meta.pkl``: ``char_vocab``)
- ``checkpoint``: a ``step_*`` checkpoint, or a run directory's newest one
- ``run_directory``: an existing run directory (its run files must be distrain's)
- ``outputs``: a path a command will write (never replacing what it did not write), and tracker stores
"""
