"""POST /orders/: create an order and enqueue its confirmation, in one transaction.

Inside ``transaction.atomic()`` taskdedup writes the job's lock in the order's transaction
(the store is this database) and publishes the job once it commits. A request that fails
after the enqueue rolls back both: no order, no lock, no job. A double-click in the same
request gets the same job.
"""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse

from .models import Order
from .tasks import send_confirmation


def create_order(request: HttpRequest) -> JsonResponse:
    with transaction.atomic():
        order = Order.objects.create(sku=request.POST["sku"])
        job = send_confirmation.delay(order.id)
        again = send_confirmation.delay(order.id)  # (a double-click: the same job)
        assert again.id == job.id
        if request.POST.get("declined"):
            raise RuntimeError("payment declined")  # rolls back the order and the job
    return JsonResponse({"order": order.id, "job": job.id})
