"""drifttool.references"""
