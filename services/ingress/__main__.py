from services.ingress.main import main
from shared.runner import run_service

run_service("ingress", main)
