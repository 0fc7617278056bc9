"""lowrank"""
