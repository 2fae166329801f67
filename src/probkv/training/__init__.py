"""Training of the shipped kvzap scorers (S11): :mod:`.scorer` fits a model's surrogate
scorer with KVzip as the teacher on generated contexts (``probkv train-scorer``); the files it
writes are read by ``probkv.scores.surrogate`` (shipped ones in ``probkv/scores/scorers/``).
Importing the package loads nothing else."""
