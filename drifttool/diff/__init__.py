"""drifttool.diff"""
