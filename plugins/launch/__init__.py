"""An engine's tensor-parallel ranks (or one crash-isolated worker) in processes of their own,
behind the same contract as an in-process engine."""
