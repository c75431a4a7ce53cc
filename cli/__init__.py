"""drifttool.cli"""
