"""specplan.planner"""
