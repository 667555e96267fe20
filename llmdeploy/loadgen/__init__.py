"""`llmdeploy bench`'s load generator: workload, async runner, statistics, verdict and compare, report, chart.

Pure decisions (parse, stats, verdict, compare, burst, schedule) are apart from the I/O (client, probe, runner,
session) so they are tested on synthetic results.
"""
