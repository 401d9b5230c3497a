"""specplan.policies"""
