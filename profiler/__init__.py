"""specplan.profiler"""
