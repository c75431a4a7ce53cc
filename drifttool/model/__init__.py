"""drifttool.model"""
