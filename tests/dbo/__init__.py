"""Tests of the dbo runtime core: scheduler, yield points, split, vote, merge, runner,
graphs, failures."""
