"""The pipeline at cluster scale with simulated compute: cost profiles (``profiles.py``), the real services with
stand-ins for their model calls (``simulated.py``), and the measurements (``bench.py``; ``python -m benchmarks.run
--only cluster``). Benchmarks only: nothing in ``common/`` or ``services/`` imports this package."""
