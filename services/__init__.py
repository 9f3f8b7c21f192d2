"""The streamppo services: one folder per pipeline role, each a thin adapter around a core in ``common/``."""
