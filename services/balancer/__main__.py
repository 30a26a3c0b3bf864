from services.balancer.main import main
from shared.runner import run_service

run_service("balancer", main)
